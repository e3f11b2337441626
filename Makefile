# Every target installs what it needs: `make test` works on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# torch first, pinned, so pip takes the local CPU wheel instead of resolving CUDA packages.
TORCH_SPEC := torch==2.13.0

.PHONY: install run dpo two-stage-kl grpo lint format typecheck pytest test docs bench clean

# The demos' torch threads, unless OMP_NUM_THREADS is set: the CPUs free now (those this
# process may use less the load average, at least 1; src/examples/free_cpus.py). Threads
# beyond the free cores make every step wait: on a busy 2-core machine the same run took 3-9x
# longer with 2 threads than with 1. The recipes print the number they use.
DEMO_THREADS = $${OMP_NUM_THREADS:-$$($(PYTHON) src/examples/free_cpus.py)}
THREADS_NOTE = echo "torch threads: $$threads (the CPUs free now; set OMP_NUM_THREADS to choose)"

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# `make run`: the embedded default corpus (the .py files of this Python's standard library,
# byte-tokenized), a few CPU minutes of training with checkpoints and validation (a progress bar
# in a terminal, runs/$(RUN_NAME)/metrics.jsonl), its curves as runs/$(RUN_NAME)/curves.png, then
# a sample.
# Run again, it resumes (or, if finished, only samples). RUN_ARGS takes dotted overrides.
DATA_DIR := data/stdlib
RUN_NAME ?= stdlib-demo
RUN_ARGS ?=
PROMPT ?= def

run: install
	$(VENV)/bin/olmolike prepare-data --stdlib -o $(DATA_DIR) --val-fraction 0.02 --workers 2
	@threads=$(DEMO_THREADS); $(THREADS_NOTE); set -x; OMP_NUM_THREADS=$$threads $(PY) src/examples/train_lm/train.py $(RUN_NAME) $(RUN_ARGS)
	$(VENV)/bin/olmolike plot runs/$(RUN_NAME) -o runs/$(RUN_NAME)/curves.png
	@echo "--- a sample from the trained model (olmolike generate runs/$(RUN_NAME) --prompt '$(PROMPT) ') ---"
	@$(VENV)/bin/olmolike generate runs/$(RUN_NAME) --prompt '$(PROMPT) ' --max-new-tokens 300

# `make moe`: a mixture of experts (moe_tiny: top-2 of 8 experts, tiny's active size) on the
# same embedded corpus, a few CPU minutes; prints each layer's expert load at the end.
# MOE_ARGS takes dotted overrides, e.g. --model.moe.load_balancing_loss_coefficient=0.
.PHONY: moe
MOE_RUN ?= moe-demo
MOE_ARGS ?=

moe: install
	$(VENV)/bin/olmolike prepare-data --stdlib -o $(DATA_DIR) --val-fraction 0.02 --workers 2
	@threads=$(DEMO_THREADS); $(THREADS_NOTE); set -x; OMP_NUM_THREADS=$$threads $(PY) src/examples/moe/train.py $(MOE_RUN) $(MOE_ARGS)

# `make sft`: fine-tune the `make run` model (trained first if runs/$(RUN_NAME) is missing) to
# write standard-library functions from their docstrings; prints the masked loss on held-out
# completions before and after. SFT_ARGS takes dotted overrides.
.PHONY: sft
SFT_RUN ?= sft-demo
SFT_ARGS ?=

sft: install
	test -d runs/$(RUN_NAME) || $(MAKE) run
	@threads=$(DEMO_THREADS); $(THREADS_NOTE); set -x; OMP_NUM_THREADS=$$threads $(PY) src/examples/sft/train.py $(SFT_RUN) --base=runs/$(RUN_NAME) $(SFT_ARGS)

# `make dpo`: DPO on stdlib preference pairs (true continuation vs shuffled), ~1 CPU minute;
# prints held-out preference accuracy before and after. DPO_ARGS takes dotted overrides.
DPO_ARGS ?=

dpo: install
	@threads=$(DEMO_THREADS); $(THREADS_NOTE); set -x; OMP_NUM_THREADS=$$threads $(PY) src/examples/dpo/train.py dpo-demo $(DPO_ARGS)

# `make two-stage-kl`: stage 1 on stdlib code, stage 2 on reversed code, with beta 0 and 1;
# prints how much the stage-1 held-out loss degrades in stage 2 (under a CPU minute).
# TWO_STAGE_ARGS takes dotted overrides.
TWO_STAGE_ARGS ?=

two-stage-kl: install
	@threads=$(DEMO_THREADS); $(THREADS_NOTE); set -x; OMP_NUM_THREADS=$$threads $(PY) src/examples/two_stage_kl/train.py two-stage-kl-demo $(TWO_STAGE_ARGS)

# `make grpo`: GRPO on generated sums (exact-answer reward) after a short warm-up, and the same
# tokens spent on more supervised training from the same warm-up, a few CPU minutes; prints the
# held-out greedy accuracy of each and draws GRPO's reward curve into $(GRPO_OUT)/reward.png.
# GRPO_ARGS takes dotted overrides, e.g. '--trainer.max_duration.value=50 --warm_up.steps=200'.
GRPO_OUT ?= runs/grpo-demo
GRPO_ARGS ?=

grpo: install
	@threads=$(DEMO_THREADS); $(THREADS_NOTE); set -x; OMP_NUM_THREADS=$$threads $(PY) src/examples/grpo/train.py $(GRPO_OUT) $(GRPO_ARGS)
	$(VENV)/bin/olmolike plot $(GRPO_OUT)/grpo -o $(GRPO_OUT)/reward.png \
		--metrics 'train/reward/*mean' 'train/KL' 'train/completion length/mean'

# `make grpo-results`: `make grpo` at full size with one thread, then its figures are kept in
# docs/results/grpo.json and the results block of docs/grpo.md is rewritten from them
# (src/examples/grpo/grpo_results.py; src/test/test_docs_results.py checks the two agree).
.PHONY: grpo-results
grpo-results: install
	OMP_NUM_THREADS=1 $(MAKE) grpo GRPO_OUT=runs/grpo-results GRPO_ARGS=
	$(PY) src/examples/grpo/grpo_results.py runs/grpo-results/accuracy.json

lint: install
	$(VENV)/bin/ruff check src
	$(VENV)/bin/ruff format --check src

format: install
	$(VENV)/bin/ruff check --fix src
	$(VENV)/bin/ruff format src

typecheck: install
	$(VENV)/bin/mypy

# PYTEST_WORKERS: parallel test processes (pytest-xdist); 2 suits the 2-core CI machine.
PYTEST_WORKERS ?= 2

pytest: install
	$(PY) -m pytest src/test -q -n $(PYTEST_WORKERS)

# pytest also runs this strict build (src/test/test_docs_site.py), with the check that the API
# reference holds every public name and config field.
test: lint typecheck pytest

# `make docs`: the site (guides from docs/*.md, API reference from the docstrings) in
# build/docs; open build/docs/index.html. Warnings (a broken reference, a public name without
# a docstring) are errors.
docs: install
	OMP_NUM_THREADS=1 $(PY) -m sphinx -W --keep-going -q -b html docs build/docs
	@echo "The site: build/docs/index.html"

bench: install
	$(PY) src/benchmarks/trainer_overhead.py
	$(PY) src/benchmarks/checkpoint_stall.py
	$(PY) src/benchmarks/checkpoint_io.py
	$(PY) src/benchmarks/data_loader.py
	$(PY) src/benchmarks/gpu_throughput.py
	$(PY) src/benchmarks/generation.py
	$(PY) src/benchmarks/moe.py
	$(PY) src/benchmarks/cli_startup.py
	$(PY) src/benchmarks/vs_olmo_core.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
	@echo "runs/ and data/ are kept: remove them yourself if you want them gone"
