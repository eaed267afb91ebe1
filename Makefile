# Every target creates .venv and installs what it needs: one command on a fresh machine.
#   make run    the package alone (what training needs)
#   make test   + the test and parity extras (pytest, CPU torch and the reference libraries)
#   make setup  everything, the SLURM launcher plugin too (development)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
SETUP_STAMP := $(VENV)/.installed-setup

.PHONY: run test test-all bench check-results setup clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(RUN_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $@

$(TEST_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[test,parity]"
	touch $@ $(RUN_STAMP)

$(SETUP_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[test,parity,slurm]"
	touch $@ $(TEST_STAMP) $(RUN_STAMP)

setup: $(SETUP_STAMP)

run: $(RUN_STAMP)
	$(PY) run.py

test: $(TEST_STAMP)
	$(PY) -m pytest -n 2 --dist loadfile

test-all: $(TEST_STAMP)
	$(PY) -m experiments.check_results --rerun-cheap --write
	$(PY) -m pytest -n 2 --dist loadfile -m ""

bench: $(TEST_STAMP)
	$(PY) -m experiments.bench_kda.bench
	$(PY) -m experiments.bench_train.bench

check-results: $(RUN_STAMP)
	$(PY) -m experiments.check_results

clean:
	rm -rf $(VENV) outputs multirun
