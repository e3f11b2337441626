# Every target installs what it needs: `make test` works on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# torch first, pinned, so pip takes the local CPU wheel instead of resolving CUDA packages.
TORCH_SPEC := torch==2.13.0

.PHONY: install lint format typecheck pytest test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

lint: install
	$(VENV)/bin/ruff check src
	$(VENV)/bin/ruff format --check src

format: install
	$(VENV)/bin/ruff check --fix src
	$(VENV)/bin/ruff format src

typecheck: install
	$(VENV)/bin/mypy

pytest: install
	$(PY) -m pytest src/test -q

test: lint typecheck pytest

bench: install
	$(PY) src/benchmarks/trainer_overhead.py
	$(PY) src/benchmarks/checkpoint_stall.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
