# flash_nif — the README's two commands are `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export VIRTUAL_ENV := $(abspath $(VENV))

PY_PACKAGES := maturin numpy ml_dtypes pytest tqdm matplotlib

.PHONY: setup build test test-rust test-python test-elixir elixir-setup demo bench-cpu clean

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

# Elixir: Debian's elixir and erlang-dev when mix is missing (as root, else through sudo).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

elixir-setup:
	@command -v mix >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq elixir erlang-dev; }

# `mix test` compiles first: cargo build --release -p flash-nif, library copied to elixir/priv/.
test-elixir: elixir-setup
	cd elixir && mix test

test: setup test-rust test-python test-elixir

demo: build
	$(PY) -m flash_nif.train --out runs/demo

bench-cpu: build
	$(PY) bench/cpu.py

clean:
	rm -rf target dist $(VENV) runs elixir/_build elixir/priv/*.so
