"""The last OLMo-core train-layer names: ``Trainer.tokens_per_batch``, ``has_callback``,
``run_bookkeeping_op(allow_multiple=..., cancel_in_progress=...)`` and the module path
``olmolike.train.callbacks.model_merger``."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from testutils import build_trainer

from olmolike.train import Callback, Duration
from olmolike.train.callbacks import EarlyStoppingCallback, model_merge


@dataclass
class Probe(Callback):
    pass


@dataclass
class SubProbe(Probe):
    pass


def test_model_merger_is_olmo_cores_path_to_the_same_objects() -> None:
    from olmolike.train.callbacks import model_merger

    for name in model_merger.__all__:
        assert getattr(model_merger, name) is getattr(model_merge, name)
    assert model_merger.compute_merge_window_starts([100, 200], 10) == [91, 191]


def test_tokens_per_batch_and_has_callback(tmp_path: Path) -> None:
    trainer = build_trainer(tmp_path, max_duration=Duration.steps(2))
    assert trainer.tokens_per_batch == trainer.global_batch_size > 0
    assert trainer.tokens_per_epoch == trainer.steps_per_epoch * trainer.tokens_per_batch
    assert not trainer.has_callback(EarlyStoppingCallback)
    assert not trainer.has_callback(Probe)
    trainer.add_callback("probe", SubProbe())
    assert trainer.has_callback(SubProbe)
    assert trainer.has_callback(Probe)  # an instance of a subclass counts, as in OLMo-core


@pytest.mark.timeout(120)
def test_run_bookkeeping_op_takes_allow_multiple_and_does_not_pass_it_on(tmp_path: Path) -> None:
    # CometCallback submits its tag check with allow_multiple=False: the option was handed to
    # the op as a keyword argument, a TypeError in the op.
    trainer = build_trainer(tmp_path, max_duration=Duration.steps(2), async_bookkeeping=True)
    started, release = threading.Event(), threading.Event()

    def check() -> str:
        started.set()
        release.wait()
        return "checked"

    first = trainer.run_bookkeeping_op(check, allow_multiple=False, distributed=False)
    assert started.wait(timeout=30), "the first invocation never started"
    again = trainer.run_bookkeeping_op(check, allow_multiple=False, distributed=False)
    assert again.cancelled()
    release.set()
    assert first.result() == "checked"
    with pytest.warns(DeprecationWarning, match="allow_multiple"):
        old = trainer.run_bookkeeping_op(check, cancel_in_progress=True, distributed=False)
    assert old.result() == "checked"
    trainer.fit()
