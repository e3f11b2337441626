"""``olmolike plot``: curves of one or more runs' metrics.jsonl files as a PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from olmolike.cli import main
from olmolike.exceptions import DataError, OLMoLikeError
from olmolike.plot import figure_for_runs, load_run, plot_runs

pytest.importorskip("matplotlib", reason="needs the plot extra: pip install 'olmolike[plot]'")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(folder: Path, steps: int = 5, lr_scale: float = 1.0, evals: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, steps + 1):
        metrics: dict[str, float] = {
            "train/CE loss": 4.0 / step,
            "optim/LR (group 0)": lr_scale * step,
            "optim/total grad norm": 1.0,
            "throughput/device/TPS": 1000.0 + step,
        }
        if evals and step % 2 == 0:
            metrics["eval/val/CE loss"] = 5.0 / step
        lines.append(
            json.dumps({"step": step, "tokens": 128 * step, "time": 0.0, "metrics": metrics})
        )
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def panels(fig: Any) -> dict[str, list[str]]:
    """Each panel's title and the labels in its legend."""
    return {ax.get_title(): [t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes}


def test_load_run_groups_values_by_metric(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "run-a"))
    assert run.name == "run-a"
    assert run.curves["train/CE loss"] == ([1, 2, 3, 4, 5], [4.0, 2.0, 4 / 3, 1.0, 0.8])
    assert run.curves["eval/val/CE loss"][0] == [2, 4]
    file_run = load_run(tmp_path / "run-a" / "metrics.jsonl")
    assert file_run.name == "run-a" and file_run.curves == run.curves


def test_default_panels_overlay_runs_with_a_legend(tmp_path: Path) -> None:
    runs = [load_run(write_run(tmp_path / "a")), load_run(write_run(tmp_path / "b", lr_scale=2))]
    fig = figure_for_runs(runs)
    assert panels(fig) == {
        "loss": [
            "a: eval/val/CE loss",
            "a: train/CE loss",
            "b: eval/val/CE loss",
            "b: train/CE loss",
        ],
        "learning rate": ["a", "b"],
        "tokens per second": ["a", "b"],
    }
    lr_ax = fig.axes[1]
    assert [list(line.get_ydata()) for line in lr_ax.get_lines()] == [
        [1.0, 2.0, 3.0, 4.0, 5.0],
        [2.0, 4.0, 6.0, 8.0, 10.0],
    ]
    assert list(lr_ax.get_lines()[0].get_xdata()) == [1, 2, 3, 4, 5]


def test_a_run_keeps_one_colour_and_a_metric_one_style(tmp_path: Path) -> None:
    runs = [load_run(write_run(tmp_path / "a")), load_run(write_run(tmp_path / "b"))]
    loss, _, tps = figure_for_runs(runs).axes
    lines = {line.get_label(): line for line in loss.get_lines()}
    assert lines["a: train/CE loss"].get_color() == lines["a: eval/val/CE loss"].get_color()
    assert lines["a: train/CE loss"].get_color() != lines["b: train/CE loss"].get_color()
    assert lines["a: train/CE loss"].get_linestyle() == "-"  # training solid, evals not
    assert lines["a: eval/val/CE loss"].get_linestyle() != "-"
    assert loss.get_ylabel() == "loss (nats/token)" and tps.get_ylabel().startswith("tokens/s")
    assert tps.get_xlabel().startswith("step")


def test_panels_without_data_are_left_out(tmp_path: Path) -> None:
    folder = tmp_path / "only-loss"
    folder.mkdir()
    record = {"step": 1, "tokens": 1, "time": 0.0, "metrics": {"train/CE loss": 3.0}}
    (folder / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    assert panels(figure_for_runs([load_run(folder)])) == {"loss": ["only-loss"]}


def test_the_loss_panel_shows_a_post_training_loss(tmp_path: Path) -> None:
    """A DPO run logs ``train/DPO loss`` (no ``train/CE loss``): the default panel shows it."""
    folder = tmp_path / "dpo"
    folder.mkdir()
    record = {"step": 1, "tokens": 1, "time": 0.0, "metrics": {"train/DPO loss": 0.69}}
    (folder / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    assert panels(figure_for_runs([load_run(folder)])) == {"loss": ["dpo"]}


def test_metric_globs_choose_the_panels(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "a"))
    fig = figure_for_runs([run], ["optim/total*", "train/*"])
    assert panels(fig) == {"optim/total*": ["a"], "train/*": ["a"]}


def test_runs_from_folders_of_the_same_name_are_told_apart(tmp_path: Path) -> None:
    runs = [
        load_run(write_run(tmp_path / "x" / "run")),
        load_run(write_run(tmp_path / "y" / "run")),
    ]
    labels = panels(figure_for_runs(runs))["learning rate"]
    assert labels == [
        str(tmp_path / "x" / "run" / "metrics.jsonl"),
        str(tmp_path / "y" / "run" / "metrics.jsonl"),
    ]


def test_plot_runs_writes_a_png(tmp_path: Path) -> None:
    out = plot_runs([write_run(tmp_path / "a")], tmp_path / "plots" / "curves.png")
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_no_matching_metric_names_the_available_ones(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"available: \['eval/val/CE loss'.*--metrics"):
        plot_runs([write_run(tmp_path / "a")], tmp_path / "c.png", ["nothing/*"])


def test_missing_metrics_file_says_how_to_get_one(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="MetricSaverCallback"):
        load_run(tmp_path)


def test_missing_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes the import fail
    with pytest.raises(OLMoLikeError, match=r"pip install 'olmolike\[plot\]'"):
        plot_runs([write_run(tmp_path / "a")], tmp_path / "c.png")


def test_cli_plots_several_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b")
    out = tmp_path / "curves.png"
    assert (
        main(["plot", str(a), str(b / "metrics.jsonl"), "-o", str(out), "--metrics", "train/*"])
        == 0
    )
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_cli_reports_a_missing_run_as_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plot", str(tmp_path / "nope"), "-o", str(tmp_path / "c.png")]) == 2
    assert "no metrics file" in capsys.readouterr().err
