"""What the accelerator can do: peak FLOP/s by device, for model FLOPs utilisation (MFU)."""

from __future__ import annotations

import logging

import torch

__all__ = ["PEAK_FLOPS", "peak_flops"]

log = logging.getLogger(__name__)

PEAK_FLOPS: dict[str, dict[torch.dtype, float]] = {
    # Dense (no sparsity) tensor-core peaks from the vendors' data sheets; the SXM parts.
    "B200": {torch.bfloat16: 2.25e15, torch.float16: 2.25e15, torch.float32: 75e12},
    "H200": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    "H100 PCIe": {torch.bfloat16: 756e12, torch.float16: 756e12, torch.float32: 51e12},
    "H100": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
    "L40S": {torch.bfloat16: 362e12, torch.float16: 362e12, torch.float32: 91.6e12},
    "A10G": {torch.bfloat16: 125e12, torch.float16: 125e12, torch.float32: 31.2e12},
    "MI300X": {torch.bfloat16: 1307e12, torch.float16: 1307e12, torch.float32: 163e12},
}
"""Peak FLOP/s per device name fragment; the longest fragment found in the name wins."""

_warned_unknown: set[str] = set()
"""Device names already warned about: a caller may ask on every step, the log needs it once."""


def peak_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """The device's peak FLOP/s for matmuls in ``dtype``, or ``None`` if unknown (e.g. a CPU).

    TF32 matmuls run at the float32 figure here; enable them and the real peak is higher.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    matches = [fragment for fragment in PEAK_FLOPS if fragment in name]
    if not matches:
        if name not in _warned_unknown:
            _warned_unknown.add(name)
            log.warning(
                "No peak FLOP/s known for %r; MFU will not be reported (add its data-sheet "
                "figure to olmolike.hardware.PEAK_FLOPS to get it)",
                name,
            )
        return None
    return PEAK_FLOPS[max(matches, key=len)].get(dtype)
