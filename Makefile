# flash_nif — the README's two commands are `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export VIRTUAL_ENV := $(abspath $(VENV))

PY_PACKAGES := maturin numpy ml_dtypes pytest tqdm matplotlib

.PHONY: setup build test test-rust test-python demo bench-cpu clean

$(VENV)/.ready:
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(PY_PACKAGES)
	touch $@

setup: $(VENV)/.ready

build: setup
	$(VENV)/bin/maturin develop --release -q

test-rust:
	cargo test --release --workspace -q

test-python: build
	$(PY) -m pytest -q

test: setup test-rust test-python

demo: build
	$(PY) -m flash_nif.train --out runs/demo

bench-cpu: build
	$(PY) bench/cpu.py

clean:
	rm -rf target dist $(VENV) runs
