"""The GRPO demonstration's results as ``docs/grpo.md`` shows them, rendered from the
``accuracy.json`` that the demonstration writes (``make grpo``: ``runs/grpo-demo``).

The demonstration prints this block when it ends. ``make grpo-results`` runs it at full size
and then ``python src/examples/grpo/grpo_results.py runs/grpo-results/accuracy.json``, which keeps
the figures in ``docs/results/grpo.json`` and rewrites the block of ``docs/grpo.md`` between
:data:`BEGIN` and :data:`END` from them; ``--check`` only says whether the guide shows the
stored figures (``src/test/test_docs_results.py`` checks it on every run). Standard library
only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
STORED = REPO / "docs" / "results" / "grpo.json"
GUIDE = REPO / "docs" / "grpo.md"
BEGIN = "<!-- results: grpo (make grpo-results writes this block from docs/results/grpo.json) -->"
END = "<!-- /results: grpo -->"


def render(result: dict[str, Any]) -> str:
    """The block: how it was measured, the accuracy table, GRPO's reward and lengths."""
    steps, seconds = result["steps"], result["seconds"]
    times = ", ".join(f"{name} {value:.0f} s" for name, value in seconds.items())
    threads = f"OMP_NUM_THREADS={result['threads']}"
    lines = [
        f"Measured ({threads}, {result['ranks']} rank(s), "
        f"{result['warm_up_steps']} warm-up steps; {times}):",
        "",
        f"| | held-out greedy accuracy ({result['held_out']} sums) |",
        "|---|---|",
        f"| after the warm-up | **{result['before']:.3f}** |",
        f"| after {steps} GRPO steps | **{result['grpo']:.3f}** |",
    ]
    if "sft" in result:
        lines.append(f"| after {steps} SFT steps, as many tokens | **{result['sft']:.3f}** |")
    reward, length = result["reward"], result["completion_length"]
    lines += [
        "",
        f"GRPO's mean reward was {reward['first']:.2f} at its first step and "
        f"{reward['last_10']:.2f} over its last 10; its completions were "
        f"{length['first']:.1f} tokens long at the first step and {length['last_10']:.1f} over "
        "the last 10 (the stop token included).",
    ]
    return "\n".join(lines)


def rewrite(guide: str, result: dict[str, Any]) -> str:
    """``guide`` with the block between :data:`BEGIN` and :data:`END` rendered anew."""
    start, end = guide.index(BEGIN) + len(BEGIN), guide.index(END)
    return guide[:start] + "\n" + render(result) + "\n" + guide[end:]


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        guide = GUIDE.read_text()
        if rewrite(guide, json.loads(STORED.read_text())) != guide:
            print(f"{GUIDE} does not show {STORED}: run make grpo-results", file=sys.stderr)
            return 1
        return 0
    if len(argv) != 1:
        print("usage: grpo_results.py ACCURACY_JSON | --check", file=sys.stderr)
        return 2
    result = json.loads(Path(argv[0]).read_text())
    STORED.write_text(json.dumps(result, indent=2) + "\n")
    GUIDE.write_text(rewrite(GUIDE.read_text(), result))
    print(f"{STORED} and the table of {GUIDE} now show {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
