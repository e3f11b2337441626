"""peak_flops: which data-sheet figure a device name maps to (no GPU needed: the name is faked)."""

from __future__ import annotations

import logging

import pytest
import torch

from olmolike.hardware import PEAK_FLOPS, peak_flops

CUDA = torch.device("cuda", 0)


def fake_gpu(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_cpu_has_no_peak() -> None:
    assert peak_flops(torch.device("cpu")) is None
    assert peak_flops(torch.device("cpu"), torch.float32) is None


def test_cuda_device_without_cuda_has_no_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peak_flops(CUDA) is None


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        # "H100" is also in the PCIe name: the longer, more specific fragment must win.
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("AMD Instinct MI300X", "MI300X"),
    ],
)
def test_device_name_picks_the_longest_fragment(
    monkeypatch: pytest.MonkeyPatch, name: str, fragment: str
) -> None:
    fake_gpu(monkeypatch, name)
    assert peak_flops(CUDA) == PEAK_FLOPS[fragment][torch.bfloat16]
    assert peak_flops(CUDA, torch.float32) == PEAK_FLOPS[fragment][torch.float32]


def test_h100_pcie_and_sxm_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    # Guards the test above: with equal figures a wrong match would go unnoticed.
    fake_gpu(monkeypatch, "NVIDIA H100 PCIe")
    pcie = peak_flops(CUDA)
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    sxm = peak_flops(CUDA)
    assert pcie == 756e12 and sxm == 989e12


def test_unlisted_dtype_has_no_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu(monkeypatch, "NVIDIA H200")
    assert peak_flops(CUDA, torch.float64) is None


def test_unknown_device_warns_once_per_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_gpu(monkeypatch, "Imaginary Accelerator 9000")
    with caplog.at_level(logging.WARNING, logger="olmolike.hardware"):
        assert peak_flops(CUDA) is None
        assert peak_flops(CUDA) is None
    warnings = [r for r in caplog.records if "Imaginary Accelerator 9000" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
