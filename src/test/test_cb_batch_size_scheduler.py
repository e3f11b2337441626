"""BatchSizeSchedulerCallback and the loaders' mid-epoch batch size changes."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from testutils import SEQ_LEN, build_trainer

from olmolike.config import Config
from olmolike.data import NumpyDataLoaderConfig, NumpyDatasetConfig, TokenTensorDataLoader
from olmolike.exceptions import ConfigurationError, DataError
from olmolike.optim.scheduler import CosWithWarmup
from olmolike.train import Callback, Duration, TrainerConfig
from olmolike.train.callbacks.batch_size_scheduler import (
    BatchSizeSchedulerCallback,
    BatchSizeStage,
    BatchSizeUnits,
)
from olmolike.train.checkpoint import Checkpointer

SEQ = 4


def scheduler(*stages: tuple[int, int], units: str = "steps") -> BatchSizeSchedulerCallback:
    return BatchSizeSchedulerCallback(
        schedule=[BatchSizeStage(start, factor) for start, factor in stages],
        units=BatchSizeUnits(units),
    )


@dataclass
class StepRecorder(Callback):
    """Each step's batch, loss and (pre-clipping) gradient; cancels the run at a step."""

    record_grads: bool = False
    cancel_at: int = 0
    batches: dict[int, torch.Tensor] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)
    grads: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def pre_step(self, batch: dict[str, Any]) -> None:
        self.batches[self.step] = batch["input_ids"].clone()

    def pre_optim_step(self) -> None:
        if self.record_grads:
            params = self.trainer.train_module.model.parameters()  # type: ignore[attr-defined]
            self.grads[self.step] = [p.grad.clone() for p in params]

    def post_step(self) -> None:
        loss = self.trainer.get_metric("CE loss", namespace="train")
        assert loss is not None
        self.losses[self.step] = loss.item()
        if self.step == self.cancel_at:
            self.trainer.cancel_run("interrupted for the test")

    def sizes(self) -> list[int]:
        return [len(self.batches[s]) for s in sorted(self.batches)]


def fit(
    save: Path, *callbacks: Callback, steps: int = 8, **kwargs: Any
) -> tuple[Any, StepRecorder]:
    recorder = StepRecorder(cancel_at=kwargs.pop("cancel_at", 0))
    recorder.record_grads = kwargs.pop("record_grads", False)
    trainer = build_trainer(save, max_duration=Duration.steps(steps), **kwargs)
    for i, cb in enumerate(callbacks):
        trainer.add_callback(f"cb{i}", cb)
    trainer.add_callback("recorder", recorder)
    trainer.fit()
    return trainer, recorder


def params(trainer: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.train_module.model.parameters()]


# -- the loaders -------------------------------------------------------------------------------


def token_loader(instances_per_batch: int = 2) -> TokenTensorDataLoader:
    data = torch.arange(20 * SEQ).reshape(20, SEQ)
    return TokenTensorDataLoader(
        data, global_batch_size=instances_per_batch * SEQ, seed=3, dp_world_size=1, dp_rank=0
    )


def first_tokens(batches: list[torch.Tensor]) -> list[int]:
    return [int(t) for batch in batches for t in batch[:, 0] // SEQ]


def test_token_loader_changes_size_from_the_next_batch_in_the_same_order() -> None:
    order = first_tokens([b["input_ids"] for b in _epoch(token_loader(1))])
    loader = token_loader(2)
    loader.reshuffle(1)
    batches = iter(loader)
    seen = [next(batches)["input_ids"] for _ in range(2)]
    with pytest.raises(DataError, match="16 tokens of this epoch are consumed"):
        loader.global_batch_size = 6 * SEQ  # 4 instances consumed, not a multiple of 6
    loader.global_batch_size = 4 * SEQ
    seen += [b["input_ids"] for b in batches]
    assert [len(b) for b in seen] == [2, 2, 4, 4, 4, 4]
    assert first_tokens(seen) == order
    assert loader.batches_processed == 6 and loader.epoch_finished


def _epoch(loader: TokenTensorDataLoader) -> list[dict[str, Any]]:
    loader.reshuffle(1)
    return list(loader)


def test_token_loader_resumes_at_a_size_changed_by_an_integer_factor() -> None:
    loader = token_loader(4)
    loader.reshuffle(1)
    batches = iter(loader)
    next(batches)
    resumed = token_loader(2)
    resumed.load_state_dict(loader.state_dict())
    resumed.reshuffle(1)
    assert first_tokens([b["input_ids"] for b in resumed]) == first_tokens(
        [b["input_ids"] for b in batches]
    )
    with pytest.raises(DataError, match="not by an integer factor"):
        token_loader(3).load_state_dict(loader.state_dict())


@pytest.mark.parametrize(
    "workers", [0, pytest.param(1, marks=[pytest.mark.slow, pytest.mark.timeout(120)])]
)
def test_numpy_loader_changes_size_mid_epoch(tmp_path: Path, workers: int) -> None:
    np.save(tmp_path / "tokens.npy", np.arange(30 * SEQ, dtype=np.uint16))
    dataset = NumpyDatasetConfig(paths=[str(tmp_path / "tokens.npy")], sequence_length=SEQ).build()
    config = NumpyDataLoaderConfig(global_batch_size=2 * SEQ, seed=5, num_workers=workers)
    loader = config.build(dataset, dp_rank=0, dp_world_size=1)
    loader.reshuffle(1)
    batches = iter(loader)
    seen = [next(batches)["index"].tolist() for _ in range(2)]
    loader.global_batch_size = 4 * SEQ  # 4 instances consumed: lines up
    seen.append(next(batches)["index"].tolist())
    state = loader.state_dict()
    seen += [b["index"].tolist() for b in batches]
    assert [len(s) for s in seen] == [2, 2, 4, 4, 4, 4, 4, 4]  # 28 of 30
    assert [i for s in seen for i in s] == loader.order(1)[:28].tolist()
    assert state["instances_consumed"] == 8 and state["batches_processed"] == 3
    resumed = config.replace(num_workers=0, global_batch_size=4 * SEQ).build(
        dataset, dp_rank=0, dp_world_size=1
    )
    resumed.load_state_dict(state)
    resumed.reshuffle(1)
    assert [b["index"].tolist() for b in resumed] == seen[3:]


# -- the schedule in training ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("units", "start"), [("steps", 4), ("tokens", 4 * 2 * SEQ_LEN), ("tokens", 7 * SEQ_LEN)]
)
def test_batches_grow_from_the_scheduled_point(tmp_path: Path, units: str, start: int) -> None:
    callback = scheduler((0, 1), (start, 2), units=units)
    trainer, rec = fit(
        tmp_path, callback, steps=7, num_instances=32, instances_per_batch=2,
        micro_batch_instances=2,
    )  # fmt: skip
    assert rec.sizes() == [2, 2, 2, 2, 4, 4, 4]  # tokens: the first step boundary at >= start
    assert trainer.global_train_tokens_seen == 20 * SEQ_LEN
    assert callback.base_batch_size == 2 * SEQ_LEN and callback.factor == 2
    plain = build_trainer(tmp_path / "plain", num_instances=32, instances_per_batch=1)
    plain.data_loader.reshuffle(1)
    order = torch.cat([b["input_ids"] for b in plain.data_loader])
    assert torch.equal(torch.cat([rec.batches[s] for s in sorted(rec.batches)]), order[:20])


def test_after_the_switch_equal_data_gives_equal_gradient(tmp_path: Path) -> None:
    """Loss and gradient stay means over the whole global batch: a batch grown by the
    schedule trains exactly like the same batch in a run with that size from the start."""

    def frozen(trainer: Any) -> None:
        for group in trainer.train_module.optim.param_groups:
            group["lr"] = 0.0  # keep the weights at init, so steps compare on equal footing

    @dataclass
    class Freeze(Callback):
        def pre_train(self) -> None:
            frozen(self.trainer)

    common: dict[str, Any] = {"num_instances": 32, "micro_batch_instances": 4}
    _, grown = fit(
        tmp_path / "grown", Freeze(), scheduler((0, 1), (2, 2)), steps=3,
        instances_per_batch=4, record_grads=True, **common,
    )  # fmt: skip
    _, fixed = fit(
        tmp_path / "fixed", Freeze(), steps=2, instances_per_batch=8, record_grads=True,
        **common,
    )  # fmt: skip
    assert grown.sizes() == [4, 4, 8] and fixed.sizes() == [8, 8]
    assert torch.equal(grown.batches[3], fixed.batches[2])
    assert grown.losses[3] == pytest.approx(fixed.losses[2], rel=1e-6)
    for a, b in zip(grown.grads[3], fixed.grads[2], strict=True):
        torch.testing.assert_close(a, b)
    # Two half batches average to the whole one: the normalisation is per global batch.
    assert (grown.losses[1] + grown.losses[2]) / 2 == pytest.approx(fixed.losses[1], rel=1e-5)
    for a1, a2, b in zip(grown.grads[1], grown.grads[2], fixed.grads[1], strict=True):
        torch.testing.assert_close((a1 + a2) / 2, b)


def test_cancel_and_resume_across_a_change_reproduces_the_run(tmp_path: Path) -> None:
    options: dict[str, Any] = {"steps": 9, "num_instances": 64, "micro_batch_instances": 2}
    full, whole = fit(
        tmp_path / "full", scheduler((0, 1), (4, 2)), instances_per_batch=2, **options
    )
    _, first = fit(
        tmp_path / "split", scheduler((0, 1), (4, 2)), instances_per_batch=2, cancel_at=6,
        **options,
    )  # fmt: skip
    assert Checkpointer.latest_checkpoint(tmp_path / "split").endswith("step6")
    shutil.copytree(tmp_path / "split", tmp_path / "other_base")
    torch.manual_seed(999)  # the resumed run must not depend on the process's RNG
    callback = scheduler((0, 1), (4, 2))
    resumed, second = fit(tmp_path / "split", callback, instances_per_batch=2, **options)
    assert resumed.checkpoint_loaded and sorted(second.losses) == list(range(7, 10))
    assert {**first.losses, **second.losses} == whole.losses  # bit for bit
    assert first.sizes() + second.sizes() == whole.sizes() == [2] * 4 + [4] * 5
    assert all(torch.equal(a, b) for a, b in zip(params(resumed), params(full), strict=True))
    # A loader configured at another size still scales the checkpoint's base.
    callback = scheduler((0, 1), (4, 2))
    _, third = fit(tmp_path / "other_base", callback, instances_per_batch=4, **options)
    assert callback.base_batch_size == 2 * SEQ_LEN and third.losses == second.losses


def test_a_change_that_cannot_line_up_after_an_epoch_boundary_waits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Epoch 1 is steps 1-5 (10 instances, 2 a batch); the stage begins after step 6, when
    # epoch 2 has consumed 2 instances: a batch of 4 only lines up one step later.
    with caplog.at_level(logging.INFO):
        trainer, rec = fit(
            tmp_path, scheduler((0, 1), (6, 2)), steps=9, num_instances=10,
            instances_per_batch=2, micro_batch_instances=2,
        )  # fmt: skip
    assert rec.sizes() == [2] * 7 + [4, 4]
    assert "waits for a batch where it lines up" in caplog.text
    assert "Step 8: global batch size 32 -> 64 tokens" in caplog.text
    assert trainer.epoch == 3  # epoch 2 ended after step 8: 10 instances hold no third 4


# -- checks ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stages", "match"),
    [
        ((), "at least one stage"),
        (((1, 1),), r"schedule\[0\].start.*must start at 0"),
        (((0, 1), (5, 2), (5, 4)), r"schedule\[2\].start.*sorted"),
        (((0, 1), (5, 2), (3, 4)), r"schedule\[2\].start.*sorted"),
    ],
)
def test_bad_schedules_fail_at_construction(stages: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        scheduler(*stages)


@pytest.mark.parametrize(("start", "factor", "bad"), [(-1, 1, "start"), (0, 0, "factor")])
def test_stage_values_are_checked(start: int, factor: int, bad: str) -> None:
    with pytest.raises(ConfigurationError, match=bad):
        BatchSizeStage(start, factor)


@pytest.mark.parametrize(
    ("units", "start", "fix"),
    [("steps", 3, "start=4"), ("tokens", 5 * SEQ_LEN, r"start=\d+ \(tokens\)")],
)
def test_a_stage_that_cannot_line_up_fails_at_attach(
    tmp_path: Path, units: str, start: int, fix: str
) -> None:
    trainer = build_trainer(tmp_path, instances_per_batch=2, micro_batch_instances=2)
    with pytest.raises(ConfigurationError, match=rf"schedule\[1\].start.*after 3 base.*{fix}"):
        trainer.add_callback("bss", scheduler((0, 1), (start, 2), units=units))


def test_micro_batches_must_divide_every_scheduled_rank_batch(tmp_path: Path) -> None:
    trainer = build_trainer(tmp_path, instances_per_batch=6, micro_batch_instances=6)
    trainer.train_module.rank_microbatch_size = 4 * SEQ_LEN  # type: ignore[attr-defined]
    with pytest.raises(ConfigurationError, match=r"schedule\[0\].factor.*rank_microbatch_size"):
        trainer.add_callback("bss", scheduler((0, 1), (6, 2)))
    trainer.add_callback("ok", scheduler((0, 2), (6, 4)))  # 12 and 24 instances: both fit


def test_a_loader_that_cannot_change_size_is_refused(tmp_path: Path) -> None:
    class FixedLayoutLoader(TokenTensorDataLoader):
        supports_batch_size_changes: ClassVar[bool] = False

    trainer = build_trainer(tmp_path)
    trainer.data_loader = FixedLayoutLoader(
        torch.zeros(16, SEQ_LEN, dtype=torch.long), global_batch_size=8 * SEQ_LEN
    )
    with pytest.raises(ConfigurationError, match="FixedLayoutLoader cannot change its batch"):
        trainer.add_callback("bss", scheduler((0, 1)))


@pytest.mark.parametrize(("duration", "warns"), [("tokens", True), ("steps", False)])
def test_a_step_lr_schedule_with_a_token_duration_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, duration: str, warns: bool
) -> None:
    max_duration = Duration.tokens(1000) if duration == "tokens" else Duration.steps(10)
    trainer = build_trainer(tmp_path, max_duration=max_duration)
    trainer.train_module.scheduler = CosWithWarmup(warmup=1)  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING):
        trainer.add_callback("bss", scheduler((0, 1)))
    assert ("the LR schedule's length shifts" in caplog.text) is warns


def test_round_trips_through_a_trainer_config() -> None:
    config = TrainerConfig(save_folder="unused").merge(
        [
            "--callbacks={bss: {_CLASS_: batch_size_scheduler, units: tokens, "
            "schedule: [{start: 0, factor: 1}, {start: 4096, factor: 4}]}}"
        ]
    )
    callback = config.callbacks["bss"]
    assert isinstance(callback, BatchSizeSchedulerCallback)
    assert callback.units == BatchSizeUnits.tokens and callback.schedule[1].factor == 4
    assert isinstance(callback.schedule[1], Config)
