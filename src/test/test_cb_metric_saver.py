"""MetricSaverCallback: one JSON line per step, durable and duplicate-free across resumes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from remote_servers import RemoteStore
from testutils import SEQ_LEN, Crash, CrashAtStep, build_trainer

from olmolike import io
from olmolike.exceptions import ConfigurationError
from olmolike.train import Callback, Duration, Trainer
from olmolike.train.callbacks import CheckpointerCallback
from olmolike.train.callbacks.metric_saver import MetricSaverCallback, read_metrics_file

TOKENS_PER_STEP = 8 * SEQ_LEN


@dataclass
class RemoteCopyAtEachStep(Callback):
    """Records, at the start of each step, the steps in the save folder's copy (None: no copy)."""

    url: str = ""
    seen: dict[int, list[int] | None] = field(default_factory=dict)

    def pre_step(self, batch: dict[str, Any]) -> None:
        del batch
        exists = io.exists(self.url)
        self.seen[self.step] = steps_in(io.read_bytes(self.url).decode()) if exists else None


def run(
    save: str | Path,
    steps: int,
    crash_at: int = 0,
    extra_callbacks: dict[str, Callback] | None = None,
    **kwargs: Any,
) -> Trainer:
    callbacks: dict[str, Callback] = {
        "metric_saver": MetricSaverCallback(),
        "checkpointer": CheckpointerCallback(save_interval=4, pre_train_checkpoint=False),
        "crash": CrashAtStep(step_to_crash=crash_at),
        **(extra_callbacks or {}),
    }
    trainer = build_trainer(
        save,
        num_instances=64,
        max_duration=Duration.steps(steps),
        metrics_collect_interval=1,
        callbacks=callbacks,
        **kwargs,
    )
    trainer.fit()
    return trainer


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def steps_in(text: str) -> list[int]:
    return [json.loads(line)["step"] for line in text.splitlines()]


def test_one_line_per_step_with_tokens_time_and_metrics(tmp_path: Path) -> None:
    trainer = build_trainer(
        tmp_path,
        max_duration=Duration.steps(5),
        metrics_collect_interval=2,  # metrics arrive late: tokens must still match each step
        no_checkpoints=True,
        callbacks={"metric_saver": MetricSaverCallback()},
    )
    trainer.fit()
    records = lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["tokens"] for r in records] == [s * TOKENS_PER_STEP for s in range(1, 6)]
    assert all(set(r) == {"step", "tokens", "time", "metrics"} for r in records)
    times = [r["time"] for r in records]
    assert times == sorted(times) and times[0] > 1.6e9
    assert all(isinstance(r["metrics"]["train/CE loss"], float) for r in records)
    assert any(name.startswith("optim/LR") for name in records[0]["metrics"])


def test_lines_are_flushed_while_training_runs(tmp_path: Path) -> None:
    seen: list[int] = []

    @dataclass
    class ReadBack(Callback):
        def post_step(self) -> None:
            seen.append(len((tmp_path / "metrics.jsonl").read_text().splitlines()))

    build_trainer(
        tmp_path,
        max_duration=Duration.steps(3),
        metrics_collect_interval=1,
        no_checkpoints=True,
        callbacks={"metric_saver": MetricSaverCallback(), "read": ReadBack()},
    ).fit()
    # Step N's metrics are logged at the end of step N + 1, after its post_step: N-2 lines are
    # on disk at step N's post_step.
    assert seen == [0, 0, 1]


def test_lines_reach_the_disk_once_per_collect_interval(tmp_path: Path) -> None:
    seen: list[int] = []

    @dataclass
    class ReadBack(Callback):
        def post_step(self) -> None:
            seen.append(len((tmp_path / "metrics.jsonl").read_text().splitlines()))

    flushes: list[int] = []

    @dataclass
    class CountFlushes(Callback):
        """Wraps the saver's open file (after its pre_train) to count flushes."""

        priority = -10

        def pre_train(self) -> None:
            saver = self.trainer.callbacks["metric_saver"]
            file = saver._file  # type: ignore[attr-defined]
            real_flush = file.flush

            def counted() -> None:
                flushes.append(self.trainer.global_step)
                real_flush()

            file.flush = counted

    build_trainer(
        tmp_path,
        max_duration=Duration.steps(7),
        metrics_collect_interval=3,
        no_checkpoints=True,
        callbacks={
            "metric_saver": MetricSaverCallback(),
            "read": ReadBack(),
            "count": CountFlushes(),
        },
    ).fit()
    # Steps 1-3, collected at step 3, arrive together at the end of step 4 and are flushed
    # together: one write per collection (steps 4, 7 and the last, short one at the end of
    # training), not one per line; then closing the file flushes (finding nothing to write).
    assert seen == [0, 0, 0, 0, 3, 3, 3]
    assert flushes == [4, 7, 7, 7, 7]
    assert steps_in((tmp_path / "metrics.jsonl").read_text()) == list(range(1, 8))


def test_resume_drops_steps_after_the_checkpoint_and_appends(tmp_path: Path) -> None:
    with pytest.raises(Crash):
        run(tmp_path, steps=8, crash_at=7)
    first = lines(tmp_path / "metrics.jsonl")
    # Step s's metrics are logged at the end of step s + 1: step 6's never were.
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5]
    run(tmp_path, steps=8)  # resumes from the checkpoint at step 4
    resumed = lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert resumed[:4] == first[:4]
    assert resumed[4]["time"] > first[4]["time"]  # steps 5 and 6 come from the second run


def test_fresh_run_empties_a_file_left_by_a_run_without_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 9, "metrics": {}}) + "\n")
    run(tmp_path, steps=2)
    assert [r["step"] for r in lines(tmp_path / "metrics.jsonl")] == [1, 2]


def test_a_torn_last_line_is_dropped_on_resume(tmp_path: Path) -> None:
    run(tmp_path, steps=4)
    path = tmp_path / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 5, "tok')
    run(tmp_path, steps=5)
    assert [r["step"] for r in lines(path)] == [1, 2, 3, 4, 5]


def test_read_metrics_file_rejects_damage_before_the_last_line() -> None:
    assert read_metrics_file('{"step": 1}\n{"st') == [{"step": 1}]
    with pytest.raises(json.JSONDecodeError):
        read_metrics_file('{"st\n{"step": 1}\n')


def test_only_rank_zero_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run(tmp_path / "rank0", steps=2)
    assert (tmp_path / "rank0" / "metrics.jsonl").read_text().count("\n") >= 2
    monkeypatch.setattr("olmolike.train.callbacks.metric_saver.get_rank", lambda: 1)
    run(tmp_path / "rank1", steps=2)
    assert not (tmp_path / "rank1" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("bucket", ["gcs_bucket", "s3_bucket"])
def test_remote_save_folder_gets_a_copy_at_checkpoints_and_the_end(
    bucket: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    store: RemoteStore = request.getfixturevalue(bucket)
    folder = store.url("run")
    remote_file = store.url("run", "metrics.jsonl")

    def remote_records() -> list[dict[str, Any]]:
        store.fs.invalidate_cache()
        return [json.loads(x) for x in store.fs.cat_file(remote_file).decode().splitlines()]

    first_run = RemoteCopyAtEachStep(url=remote_file)
    with pytest.raises(Crash):
        run(
            folder,
            steps=8,
            crash_at=7,
            extra_callbacks={"remote": first_run},
            work_dir=str(tmp_path / "work"),
            async_bookkeeping=False,  # the same steps on a GPU (no CPU group) as on CPU
        )
    # No copy before the step-4 checkpoint; the checkpoint's copy holds the steps logged by
    # then (step s's metrics are logged at the end of step s + 1, so steps 1 and 2), and
    # nothing refreshes it until the run fails, when the copy catches up with every logged
    # step. (The crash callback runs first at step 7, so the last record is from step 5.)
    assert first_run.seen == {1: None, 2: None, 3: None, 4: None, 5: [1, 2], 6: [1, 2]}
    first = remote_records()
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5]
    assert first == lines(tmp_path / "work" / "metrics.jsonl")

    # A new machine (a fresh work_dir): only the save folder's copy and checkpoints are left.
    resumed_run = RemoteCopyAtEachStep(url=remote_file)
    run(
        folder,
        steps=8,
        extra_callbacks={"remote": resumed_run},
        work_dir=str(tmp_path / "work2"),
        async_bookkeeping=False,
    )
    assert list(resumed_run.seen) == [5, 6, 7, 8]  # resumed from the step-4 checkpoint
    resumed = remote_records()
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6, 7, 8]  # each step exactly once
    assert resumed[:4] == first[:4]
    assert resumed[4]["time"] > first[4]["time"]  # steps 5 and 6 come from the second run
    assert resumed == lines(tmp_path / "work2" / "metrics.jsonl")
    assert any(p.startswith("step8/") for p in store.objects("run"))  # the final checkpoint


@pytest.mark.parametrize("fname", ["", "a/b.jsonl", ".", ".."])
def test_file_name_must_be_plain(fname: str) -> None:
    with pytest.raises(ConfigurationError, match="fname"):
        MetricSaverCallback(fname=fname)
