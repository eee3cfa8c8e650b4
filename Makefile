# One-command set-up: `make demo` runs the default experiment, `make test` the suite
# (`make test-fast` without the slow training loops). --dist=worksteal: an idle worker takes
# queued tests from the other, so the long tests do not leave one worker alone at the end;
# --durations prints the slowest tests, the ones to look at when the suite grows past 10 minutes.
# `make test` runs pytest twice: the tests marked several_devices (pytest.ini) on
# tests/conftest.py's 8 fake CPU devices, then the rest on one: XLA:CPU splits each program
# of a training run 8 ways on the 8, where the longest in-process runs take 1.25x as long
# (docs/performance.md, "The test suite"). The fast set, mostly unit tests, gains less
# than a second pytest run costs: one run on the 8.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

# Pinned: every install takes the exact versions of constraints.txt (setup.py keeps ranges).
# pip byte-compiles what it installs one file at a time; here it installs without, and
# compileall writes the same .pyc files on every core (`-j 0`) after each step, skipping
# those already written: a fresh set-up takes ~25 s less on 2 cores (docs/performance.md,
# "The test suite"). Like pip's own pass it passes over files this Python cannot compile
# (a few of torch's are written for Python 3.12), quietly.
PIN := --no-compile -c constraints.txt
BYTE_COMPILE := $(BIN)/python -m compileall -qq -j 0 $(VENV)/lib/python3*/site-packages || true

.PHONY: demo test test-fast lint format install install-test constraints clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python setup.py constraints.txt
	$(BIN)/pip install -q -e . $(PIN)
	$(BYTE_COMPILE)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[test]" $(PIN)
	$(BYTE_COMPILE)
	touch $@

$(VENV)/.installed-lint: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[lint]" $(PIN)
	$(BYTE_COMPILE)
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(BIN)/python -m experiments.demo

PYTEST := $(BIN)/python -m pytest -n auto --dist=worksteal -q
ONE_DEVICE := XLA_FLAGS=--xla_force_host_platform_device_count=1

test: $(VENV)/.installed-test
	$(PYTEST) -m several_devices tests
	$(ONE_DEVICE) $(PYTEST) --durations=25 -m "not several_devices" tests

# Everything but the tests marked slow (pytest.ini).
test-fast: $(VENV)/.installed-test
	$(PYTEST) -m "not slow" tests

# pyink (2-space indentation, 100 columns) and ruff (ruff.toml) over the repository's Python.
LINTED := mtrl_jax experiments configs benchmarks tests setup.py
PYINK := $(BIN)/pyink --pyink-indentation=2 --line-length=100
lint: $(VENV)/.installed-lint
	$(PYINK) --check -q $(LINTED)
	$(BIN)/ruff check -q $(LINTED)

format: $(VENV)/.installed-lint
	$(PYINK) -q $(LINTED)
	$(BIN)/ruff check -q --fix $(LINTED)

# Re-pins to the venv's versions (after `pip install -U -e ".[test]"` and a passing make test).
constraints:
	{ grep '^#' constraints.txt; $(BIN)/pip freeze --exclude-editable | grep -v -i '^mtrl[_-]jax' \
	  | sed 's/^torch==\(.*\)+cpu$$/torch==\1/'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) *.egg-info
