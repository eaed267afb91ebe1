# Every target creates .venv and installs what it needs: one command on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-all bench check-results setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,parity,slurm]"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(PY) run.py

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile

test-all: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile -m ""

bench: $(STAMP)
	$(PY) -m experiments.bench_kda.bench
	$(PY) -m experiments.bench_train.bench

check-results: $(STAMP)
	$(PY) -m experiments.check_results

clean:
	rm -rf $(VENV) outputs multirun
