# One-command set-up: `make demo` runs the default experiment, `make test` the suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test install install-test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python setup.py
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(BIN)/python -m experiments.demo

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n auto -q tests

clean:
	rm -rf $(VENV) *.egg-info
