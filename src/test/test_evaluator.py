"""The evaluator callbacks: what the held-out loss is, when it is computed, and on several ranks."""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from testutils import run_distributed_test

from olmolike.data import TokenTensorDataLoader
from olmolike.data.numpy_dataset import NumpyDatasetConfig
from olmolike.distributed.parallel import DataParallelConfig
from olmolike.distributed.utils import broadcast_object, get_world_size
from olmolike.exceptions import ConfigurationError
from olmolike.nn import Transformer, TransformerConfig
from olmolike.optim import AdamWConfig
from olmolike.testing import random_token_instances
from olmolike.train import Callback, Duration, Trainer, TrainerConfig
from olmolike.train.callbacks import EvaluatorCallback, LMEvaluatorCallbackConfig
from olmolike.train.callbacks.evaluator import Evaluator, _PeriodicEvaluation
from olmolike.train.train_module import TrainModule, TransformerTrainModuleConfig

SEQ_LEN = 16
VOCAB = 64
INSTANCES_PER_BATCH = 4


def model_config() -> TransformerConfig:
    return TransformerConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_sequence_length=32
    )


def write_eval_data(folder: Path, num_instances: int, *, tail: int = 5, seed: int = 7) -> Path:
    """``num_instances`` whole instances plus a ``tail`` shorter than one, which must be dropped.

    The instances are split over two files, so reading crosses a file boundary.
    """
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, num_instances * SEQ_LEN + tail, dtype=np.uint16)
    first = (num_instances // 2) * SEQ_LEN
    np.save(folder / "part-00000.npy", tokens[:first])
    np.save(folder / "part-00001.npy", tokens[first:])
    return folder


def eval_instances(folder: Path) -> torch.Tensor:
    """The complete instances of each file, read with numpy alone: ``(N, SEQ_LEN)``."""
    rows = []
    for path in sorted(folder.glob("*.npy")):
        tokens = np.load(path).astype(np.int64)
        whole = len(tokens) // SEQ_LEN * SEQ_LEN
        rows.append(torch.from_numpy(tokens[:whole]).reshape(-1, SEQ_LEN))
    return torch.cat(rows)


def direct_ce(model: torch.nn.Module, instances: torch.Tensor) -> float:
    """Mean next-token cross-entropy over every label of every instance, in one forward."""
    with torch.no_grad():
        logits = model(instances).double()
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), instances[:, 1:].reshape(-1)
    ).item()


@dataclass
class EvalLog(Callback):
    """The eval metrics of each logged step."""

    metrics: dict[int, dict[str, float]] = field(default_factory=dict)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        evals = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if evals:
            self.metrics.setdefault(step, {}).update(evals)

    def ce(self) -> dict[int, float]:
        return {step: m["eval/lm/CE loss"] for step, m in sorted(self.metrics.items())}


def build(
    save: str | Path,
    evaluator: Callback,
    *,
    steps: int = 3,
    dp: DataParallelConfig | None = None,
    **trainer_kwargs: Any,
) -> tuple[Trainer, EvalLog]:
    rank_instances = INSTANCES_PER_BATCH // get_world_size()
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=rank_instances * SEQ_LEN, optim=AdamWConfig(lr=1e-2), dp_config=dp
    ).build(model_config().build(seed=0))
    loader = TokenTensorDataLoader(
        random_token_instances(32, SEQ_LEN, VOCAB, seed=1),
        global_batch_size=INSTANCES_PER_BATCH * SEQ_LEN,
    )
    log = EvalLog()
    trainer = TrainerConfig(
        save_folder=str(save),
        device="cpu",
        metrics_collect_interval=1,
        no_checkpoints=True,
        max_duration=Duration.steps(steps),
        callbacks={"evaluator": evaluator, "eval_log": log},
        **trainer_kwargs,
    ).build(module, loader)
    return trainer, log


def lm_evaluator(data: Path, **kwargs: Any) -> LMEvaluatorCallbackConfig:
    dataset = NumpyDatasetConfig(paths=[str(data)], sequence_length=SEQ_LEN)
    kwargs.setdefault("eval_on_finish", True)  # these tests read the final step's metrics
    return LMEvaluatorCallbackConfig(eval_dataset=dataset, **kwargs)


def trained_model(trainer: Trainer) -> Transformer:
    model = trainer.train_module.model  # type: ignore[attr-defined]
    assert isinstance(model, Transformer)
    return model


# -- the loss --------------------------------------------------------------------------------


def test_loss_is_the_mean_ce_over_every_label(tmp_path: Path) -> None:
    data = write_eval_data(tmp_path / "eval", 7)
    # 7 instances in batches of 3: the last batch is short.
    trainer, log = build(tmp_path / "run", lm_evaluator(data, eval_batch_size=3, eval_interval=5))
    trainer.fit()
    assert list(log.ce()) == [3]  # the final step, which is no multiple of the interval
    want = direct_ce(trained_model(trainer), eval_instances(data))
    assert log.ce()[3] == pytest.approx(want, rel=1e-5)
    assert log.metrics[3]["eval/lm/PPL"] == pytest.approx(math.exp(want), rel=1e-5)


def test_max_batches_limits_the_data(tmp_path: Path) -> None:
    data = write_eval_data(tmp_path / "eval", 7)
    trainer, log = build(
        tmp_path / "run", lm_evaluator(data, eval_batch_size=2, max_batches=2, label="val")
    )
    trainer.fit()
    ce = log.metrics[3]["eval/val/CE loss"]
    instances = eval_instances(data)
    assert ce == pytest.approx(direct_ce(trained_model(trainer), instances[:4]), rel=1e-5)
    assert ce != pytest.approx(direct_ce(trained_model(trainer), instances), rel=1e-4)


def test_startup_eval_uses_the_initial_weights(tmp_path: Path) -> None:
    data = write_eval_data(tmp_path / "eval", 5)
    trainer, log = build(tmp_path / "run", lm_evaluator(data, eval_on_startup=True), steps=2)
    trainer.fit()
    assert list(log.ce()) == [0, 2]
    initial = direct_ce(model_config().build(seed=0), eval_instances(data))
    assert log.ce()[0] == pytest.approx(initial, rel=1e-5)
    assert log.ce()[2] == pytest.approx(
        direct_ce(trained_model(trainer), eval_instances(data)), rel=1e-5
    )


def test_no_evals_disables_the_lm_evaluator(tmp_path: Path) -> None:
    data = write_eval_data(tmp_path / "eval", 5)
    evaluator = lm_evaluator(data, eval_interval=1, eval_on_startup=True)
    trainer, log = build(tmp_path / "run", evaluator, no_evals=True)
    trainer.fit()
    assert trainer.global_step == 3 and log.metrics == {}


# -- when it runs ----------------------------------------------------------------------------


class StepRecorder(Evaluator):
    """Records the step of every evaluation; its metric is that step."""

    def __init__(self) -> None:
        super().__init__("probe")
        self.steps: list[int] = []

    def evaluate(self, train_module: TrainModule) -> dict[str, torch.Tensor]:
        step = train_module.trainer.global_step
        self.steps.append(step)
        return {"step": torch.tensor(float(step))}


@pytest.mark.parametrize(
    ("settings", "steps", "want"),
    [
        ({"eval_interval": 2, "eval_on_finish": True}, 5, [2, 4, 5]),
        ({"eval_interval": 2, "eval_on_finish": True}, 4, [2, 4]),  # due anyway: only once
        ({"eval_interval": 2}, 3, [2]),  # eval_on_finish is off by default, as in OLMo-core
        ({"eval_interval": 2, "eval_on_startup": True}, 2, [0, 2]),
        ({"eval_interval": 1}, 2, [1, 2]),
    ],
)
def test_evaluation_schedule(
    tmp_path: Path, settings: dict[str, Any], steps: int, want: list[int]
) -> None:
    recorder = StepRecorder()
    trainer, log = build(
        tmp_path, EvaluatorCallback(evaluators=[recorder], **settings), steps=steps
    )
    trainer.fit()
    assert recorder.steps == want
    # Each evaluation's metrics are logged under the step it ran at.
    assert {s: m["eval/probe/step"] for s, m in log.metrics.items()} == {s: s for s in want}


def test_no_evals_disables_every_evaluation(tmp_path: Path) -> None:
    recorder = StepRecorder()
    evaluator = EvaluatorCallback(evaluators=[recorder], eval_interval=1, eval_on_startup=True)
    trainer, _ = build(tmp_path, evaluator, no_evals=True)
    trainer.fit()
    assert recorder.steps == []


def test_lm_evaluator_round_trips_through_the_trainer_config(tmp_path: Path) -> None:
    data = write_eval_data(tmp_path / "eval", 5)
    config = TrainerConfig(save_folder=str(tmp_path), callbacks={"lm": lm_evaluator(data)})
    merged = TrainerConfig.from_dict(config.as_config_dict()).merge(
        ["callbacks.lm.eval_interval=4", "callbacks.lm.max_batches=2"]
    )
    evaluator = merged.callbacks["lm"]
    assert isinstance(evaluator, LMEvaluatorCallbackConfig)
    assert (evaluator.eval_interval, evaluator.max_batches) == (4, 2)
    assert evaluator.eval_dataset == lm_evaluator(data).eval_dataset


# -- invalid settings ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "path"),
    [
        ({"eval_dataset": None}, "eval_dataset"),
        ({"eval_interval": 0}, "eval_interval"),
        ({"eval_batch_size": 0}, "eval_batch_size"),
        ({"max_batches": 0}, "max_batches"),
        ({"label": ""}, "label"),
    ],
)
def test_invalid_settings_fail_at_construction(
    tmp_path: Path, settings: dict[str, Any], path: str
) -> None:
    kwargs = {"eval_dataset": NumpyDatasetConfig(paths=[str(tmp_path)]), **settings}
    with pytest.raises(ConfigurationError, match=f"^{path}: "):
        LMEvaluatorCallbackConfig(**kwargs)


@pytest.mark.parametrize("cls", [EvaluatorCallback, LMEvaluatorCallbackConfig])
def test_every_periodic_evaluation_checks_its_interval(
    tmp_path: Path, cls: type[_PeriodicEvaluation]
) -> None:
    extra = {"eval_dataset": NumpyDatasetConfig(paths=[str(tmp_path)])}
    with pytest.raises(ConfigurationError, match=r"^eval_interval: must be >= 1"):
        cls(eval_interval=-1, **(extra if cls is LMEvaluatorCallbackConfig else {}))


@pytest.mark.parametrize("problem", ["too short", "missing"])
def test_unusable_eval_data_fails_when_the_trainer_is_built(tmp_path: Path, problem: str) -> None:
    folder = tmp_path / "eval"
    if problem == "too short":  # fewer tokens than one instance
        folder.mkdir()
        np.save(folder / "part-00000.npy", np.arange(SEQ_LEN - 1, dtype=np.uint16))
    with pytest.raises(ConfigurationError, match=r"^eval_dataset: "):
        build(tmp_path / "run", lm_evaluator(folder))


# -- several ranks ---------------------------------------------------------------------------


def _two_rank_eval(data: str, dp: dict[str, Any]) -> dict[int, float]:
    save = broadcast_object(tempfile.mkdtemp())
    # 5 instances in rank batches of 2: rank 0 gets [0, 2], [4] and rank 1 gets [1, 3], then
    # nothing; it must still join the second forward, which a sharded model needs.
    evaluator = lm_evaluator(Path(data), eval_batch_size=2, eval_on_startup=True)
    trainer, log = build(save, evaluator, steps=1, dp=DataParallelConfig.from_dict(dp))
    trainer.fit()
    return log.ce()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("dp", [{"name": "ddp"}, {"name": "fsdp"}], ids=["ddp", "fsdp"])
def test_two_ranks_with_uneven_batches_match_one(tmp_path: Path, dp: dict[str, Any]) -> None:
    data = write_eval_data(tmp_path / "eval", 5)
    initial = direct_ce(model_config().build(seed=0), eval_instances(data))
    results = run_distributed_test(_two_rank_eval, 2, args=(str(data), dp), timeout=120)
    for ce in results:
        assert list(ce) == [0, 1]
        assert ce[0] == pytest.approx(initial, rel=1e-5)
    # Both ranks log the same, all-reduced value.
    assert results[0] == results[1]


def _two_rank_max_batches_eval(data: str) -> dict[int, float]:
    save = broadcast_object(tempfile.mkdtemp())
    evaluator = lm_evaluator(Path(data), eval_batch_size=2, max_batches=2, eval_on_startup=True)
    trainer, log = build(save, evaluator, steps=1)
    trainer.fit()
    return log.ce()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_max_batches_scores_the_same_subset_at_any_world_size(tmp_path: Path) -> None:
    # 7 instances, max_batches=2 of 2: the first 4 instances, whether one rank runs 2 forwards
    # or two ranks run 1 each (per-rank counting would score all 7 on two ranks).
    data = write_eval_data(tmp_path / "eval", 7)
    initial = model_config().build(seed=0)
    want = direct_ce(initial, eval_instances(data)[:4])
    single = _two_rank_max_batches_eval(str(data))
    results = run_distributed_test(_two_rank_max_batches_eval, 2, args=(str(data),), timeout=120)
    for ce in [single, *results]:
        assert ce[0] == pytest.approx(want, rel=1e-5)
    assert results[0][0] == pytest.approx(single[0], rel=1e-6)
    assert want != pytest.approx(direct_ce(initial, eval_instances(data)), rel=1e-4)
