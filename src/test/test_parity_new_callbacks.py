"""The callbacks added for OLMo-core parity: list checkpointer, removal strategies, Slack,
monkey patcher, sequence-length warm-up, GAP monitor, HF converter, Comet."""

from __future__ import annotations

import http.server
import json
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from safetensors.torch import load_file
from test_evaluator import build as build_transformer_trainer
from testutils import SEQ_LEN, Crash, CrashAtStep, build_trainer, free_port, run_distributed_test

from olmolike.exceptions import ConfigurationError
from olmolike.nn.hf_export import convert_to_hf
from olmolike.train import Callback, Checkpointer, Duration
from olmolike.train.callbacks import (
    CheckpointRemovalStrategy,
    CometCallback,
    GAPMonitorCallback,
    HFConverterCallback,
    ListCheckpointerCallback,
    MonkeyPatcherCallback,
    SequenceLengthSchedulerCallback,
    SlackNotifierCallback,
)
from olmolike.train.callbacks.list_checkpointer import checkpoints_to_remove
from olmolike.train.callbacks.sequence_length_scheduler import (
    melt_batch,
    split_sequence_length,
    truncate_batch,
    truncated_sequence_length,
)

# -- list checkpointer and removal strategies ------------------------------------------------


def test_list_checkpointer_saves_at_the_listed_steps(tmp_path: Path) -> None:
    saver = ListCheckpointerCallback(save_steps=[2, 5])
    build_trainer(tmp_path, max_duration=Duration.steps(6), callbacks={"checkpointer": saver}).fit()
    assert [step for step, _ in Checkpointer.find_checkpoints(tmp_path)] == [0, 2, 5, 6]
    with pytest.raises(ConfigurationError, match="save_steps"):
        ListCheckpointerCallback()
    with pytest.raises(ConfigurationError, match="save_steps"):
        ListCheckpointerCallback(save_steps=[0])


def test_checkpoint_removal_strategies() -> None:
    found = [(0, "s0", False), (3, "s3", False), (4, "s4", False), (5, "s5", True), (6, "s6", True)]
    remove = CheckpointRemovalStrategy
    assert checkpoints_to_remove(remove.never, found, save_interval=2) == []
    assert checkpoints_to_remove(remove.ephemeral_only, found, save_interval=2, keep=["s6"]) == [
        "s5"
    ]
    assert checkpoints_to_remove(remove.all_non_permanent, found, save_interval=2) == [
        "s3",
        "s5",
        "s6",
    ]
    assert CheckpointRemovalStrategy("all_non_permanent") is remove.all_non_permanent


# -- Slack -----------------------------------------------------------------------------------


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[str]]]:
    """A webhook server on 127.0.0.1 that records the text of every post."""
    texts: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            texts.append(json.loads(body)["text"])
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", texts
    server.shutdown()
    server.server_close()


def test_slack_posts_every_event_with_progress(
    tmp_path: Path, webhook: tuple[str, list[str]]
) -> None:
    url, texts = webhook
    slack = SlackNotifierCallback(name="tiny", notifications="all", webhook_url=url)  # type: ignore[arg-type]
    build_trainer(tmp_path, max_duration=Duration.steps(2), callbacks={"slack": slack}).fit()
    firsts = [t.splitlines()[0] for t in texts]
    assert "Run `tiny` started" in firsts
    assert f"Run `tiny` saved a checkpoint to {tmp_path / 'step0'}" in firsts
    assert firsts[-1] == "Run `tiny` completed successfully"
    assert "- step: 2" in texts[-1] and "- tokens: 256" in texts[-1]


def test_slack_end_only_reports_a_failure(
    tmp_path: Path, webhook: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, texts = webhook
    monkeypatch.setenv("SLACK_WEBHOOK_URL", url)
    trainer = build_trainer(
        tmp_path,
        max_duration=Duration.steps(4),
        no_checkpoints=True,
        callbacks={"slack": SlackNotifierCallback(), "crash": CrashAtStep(step_to_crash=2)},
    )
    with pytest.raises(Crash):
        trainer.fit()
    assert len(texts) == 1
    assert texts[0].startswith("Run failed with Crash:\n```\ncrash at step 2\n```")


def test_slack_needs_a_webhook_and_survives_a_dead_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("SLACK_WEBHOOK_URL", raising=False)
    with pytest.raises(ConfigurationError, match="SLACK_WEBHOOK_URL"):
        build_trainer(tmp_path / "a", callbacks={"slack": SlackNotifierCallback()})
    dead = SlackNotifierCallback(webhook_url=f"http://127.0.0.1:{free_port()}/x", timeout=5)
    build_trainer(
        tmp_path / "b", max_duration=Duration.steps(1), no_checkpoints=True, callbacks={"s": dead}
    ).fit()
    assert "Could not post a Slack notification" in caplog.text


# -- monkey patcher --------------------------------------------------------------------------


def _submesh_identity() -> tuple[bool, bool, bool]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replica", "shard"))
    before = mesh["shard"] is mesh["shard"]
    patcher = MonkeyPatcherCallback()
    patcher.pre_train()
    during = mesh["shard"] is mesh["shard"]
    patcher.close()
    after = mesh["shard"] is mesh["shard"]
    return before, during, after


@pytest.mark.timeout(180)
def test_monkey_patcher_caches_submeshes_while_training() -> None:
    for result in run_distributed_test(_submesh_identity, world_size=2):
        assert result == (False, True, False)


# -- sequence-length warm-up -----------------------------------------------------------------


def test_scheduled_lengths() -> None:
    assert [split_sequence_length(4, 16, s, 8) for s in (0, 1, 3, 4, 7, 8, 9)] == [
        4,
        4,
        8,
        8,
        8,
        16,
        16,
    ]
    assert [truncated_sequence_length(4, 16, s, 8, 4) for s in (0, 2, 3, 8)] == [4, 4, 8, 16]


def test_melt_and_truncate_batches() -> None:
    ids = torch.arange(16).reshape(2, 8)
    batch = {"input_ids": ids, "label_mask": ids % 3 != 0, "index": torch.tensor([7, 9])}
    melted = melt_batch(batch, 4)
    assert melted["input_ids"].tolist() == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    ]
    assert melted["index"].tolist() == [7, 7, 9, 9]
    assert torch.equal(melted["label_mask"], melted["input_ids"] % 3 != 0)
    cut = truncate_batch(batch, 3)
    assert cut["input_ids"].tolist() == [[0, 1, 2], [8, 9, 10]] and "index" not in cut
    with pytest.raises(ConfigurationError, match="doc_lens"):
        melt_batch({"input_ids": ids, "doc_lens": [[8], [8]]}, 4)


@dataclass
class ShapeLog(Callback):
    priority: ClassVar[int] = -5  # after the scheduler has reshaped the batch
    shapes: list[tuple[int, ...]] = field(default_factory=list)

    def pre_step(self, batch: dict[str, Any]) -> None:
        self.shapes.append(tuple(batch["input_ids"].shape))


@pytest.mark.parametrize(
    ("truncate", "want"),
    [
        (False, [(32, 4), (16, 8), (16, 8), (8, 16), (8, 16)]),
        (True, [(8, 4), (8, 8), (8, 12), (8, 16), (8, 16)]),
    ],
)
def test_sequence_length_warmup_in_training(
    tmp_path: Path, truncate: bool, want: list[tuple[int, int]]
) -> None:
    log = ShapeLog()
    scheduler = SequenceLengthSchedulerCallback(
        min_sequence_length=4, warmup_steps=4, truncate=truncate, keep_multiple_of=4
    )
    trainer = build_trainer(
        tmp_path,
        max_duration=Duration.steps(5),
        no_checkpoints=True,
        micro_batch_instances=4,
        metrics_collect_interval=1,
        callbacks={"seq": scheduler, "log": log},
    )
    trainer.fit()
    assert log.shapes == want
    assert trainer.train_module.rank_microbatch_size == 4 * SEQ_LEN  # type: ignore[attr-defined]


def test_sequence_length_needs_a_power_of_two_multiple(tmp_path: Path) -> None:
    scheduler = SequenceLengthSchedulerCallback(min_sequence_length=3, warmup_steps=4)
    trainer = build_trainer(tmp_path, no_checkpoints=True, callbacks={"seq": scheduler})
    with pytest.raises(ConfigurationError, match="power of 2"):
        trainer.fit()


# -- GAP monitor -----------------------------------------------------------------------------


@dataclass
class MetricLog(Callback):
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    weights: dict[int, torch.Tensor] = field(default_factory=dict)

    def pre_step(self, batch: dict[str, Any]) -> None:
        model = self.trainer.train_module.model  # type: ignore[attr-defined]
        self.weights[self.step] = model.head.weight.detach().clone()

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics[step] = metrics


def test_gap_monitor_records_statistics(tmp_path: Path) -> None:
    log = MetricLog()
    build_trainer(
        tmp_path,
        max_duration=Duration.steps(4),
        no_checkpoints=True,
        metrics_collect_interval=1,
        callbacks={"gap": GAPMonitorCallback(interval=2), "log": log},
    ).fit()
    assert not any(k.startswith("gap/") for k in log.metrics[1])
    metrics = log.metrics[2]
    var, mean = torch.var_mean(log.weights[2].float(), correction=0)
    assert metrics["gap/params/head.weight/mean"] == pytest.approx(mean.item(), rel=1e-5)
    assert metrics["gap/params/head.weight/var"] == pytest.approx(var.item(), rel=1e-5)
    for kind in ("grads", "activations", "activation_grads"):
        names = [k for k in metrics if k.startswith(f"gap/{kind}/")]
        assert names and all(math.isfinite(metrics[k]) for k in names), kind
    assert "gap/activations/blocks.0/max" in metrics
    assert "gap/activation_grads/head/var" in metrics


def test_gap_monitor_dumps_gradients(tmp_path: Path) -> None:
    sampled = GAPMonitorCallback(
        monitor=False, dump_gradients=True, dump_gradients_save_first_n=3,
        dump_gradients_start_step=2, dump_gradients_end_step=3,
    )  # fmt: skip
    build_trainer(
        tmp_path / "a",
        max_duration=Duration.steps(4),
        no_checkpoints=True,
        callbacks={"g": sampled},
    ).fit()
    steps = sorted(p.name for p in (tmp_path / "a" / "gradients").iterdir())
    assert steps == ["step2", "step3"]
    grad = load_file(
        tmp_path / "a" / "gradients" / "step2" / "sampled_gradients" / "head.weight.safetensors"
    )
    assert grad["gradient"].shape == (3, 3)

    full = GAPMonitorCallback(monitor=False, dump_gradients=True)
    build_trainer(
        tmp_path / "b", max_duration=Duration.steps(1), no_checkpoints=True, callbacks={"g": full}
    ).fit()
    assert (tmp_path / "b" / "gradients" / "step1" / "full_gradients" / ".metadata").is_file()
    with pytest.raises(ConfigurationError, match="enabled"):
        GAPMonitorCallback(enabled=False, monitor=True)
    with pytest.raises(ConfigurationError, match="monitor"):
        GAPMonitorCallback(monitor=False)


# -- HF converter ----------------------------------------------------------------------------


def test_hf_converter_writes_the_final_model(tmp_path: Path) -> None:
    converter = HFConverterCallback(dtype=None)
    trainer, _ = build_transformer_trainer(tmp_path, converter, steps=3)
    trainer.fit()
    out = tmp_path / "step3-hf"
    config = json.loads((out / "config.json").read_text())
    model = trainer.train_module.model  # type: ignore[attr-defined]
    want, _ = convert_to_hf(model.state_dict(), model.config)
    got = load_file(out / "model.safetensors")
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert config["architectures"]

    bf16 = HFConverterCallback(output_folder=str(tmp_path / "bf16"))
    trainer, _ = build_transformer_trainer(tmp_path / "second", bf16, steps=1)
    trainer.fit()
    assert all(
        t.dtype == torch.bfloat16
        for t in load_file(tmp_path / "bf16" / "model.safetensors").values()
    )


def test_hf_converter_needs_a_transformer(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"olmolike\.nn\.Transformer"):
        build_trainer(tmp_path, callbacks={"hf": HFConverterCallback()})


# -- Comet -----------------------------------------------------------------------------------


def test_comet_needs_its_package(tmp_path: Path) -> None:
    try:
        import comet_ml  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigurationError, match="comet_ml"):
            build_trainer(tmp_path, callbacks={"comet": CometCallback(offline=True)})
    else:
        pytest.skip("comet_ml is installed: the offline test covers it")


def test_comet_offline_experiment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("comet_ml", reason="needs the comet_ml package")
    monkeypatch.delenv("COMET_API_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="COMET_API_KEY"):
        build_trainer(tmp_path / "online", callbacks={"comet": CometCallback()})
    comet = CometCallback(
        offline=True, name="tiny", project="olmolike", offline_directory=str(tmp_path / "c")
    )
    build_trainer(
        tmp_path / "run", max_duration=Duration.steps(3), metrics_collect_interval=1,
        no_checkpoints=True, callbacks={"comet": comet},
    ).fit()  # fmt: skip
    archives = list((tmp_path / "c").glob("*.zip"))
    assert len(archives) == 1
    import zipfile

    with zipfile.ZipFile(archives[0]) as z:
        text = b"".join(z.read(n) for n in z.namelist())
    assert b"train/CE loss" in text and b"tiny" in text
