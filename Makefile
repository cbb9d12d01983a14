# vitlab: `make pretrain`, then `make finetune`; `make test` checks everything.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: install test bench

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -e '.[dev]'
	touch $@

test: install
	$(PY) -m pytest tests $(PYTEST_ARGS)

bench: install
	$(PY) bench/bench_model.py $(BENCH_ARGS)
