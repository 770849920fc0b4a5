# flash_nif — the README's two commands are `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export VIRTUAL_ENV := $(abspath $(VENV))

# nvidia-cuda-nvrtc: NVRTC for the kernel compile check (needs no GPU).
PY_PACKAGES := maturin numpy ml_dtypes pytest tqdm matplotlib threadpoolctl nvidia-cuda-nvrtc

.PHONY: setup build test test-rust test-python test-kernels test-kernels-all test-elixir elixir-setup demo bench-cpu bench-gpu clean

# Re-run when this file changes, so a new package reaches existing environments too.
$(VENV)/.ready: Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(PY_PACKAGES)
	touch $@

setup: $(VENV)/.ready

# PIP_QUIET: maturin hands pip every requirement, the optional extras' too, and pip would print an
# "Ignoring cupy-cuda13x: markers 'extra == ...'" line for each one on every build (errors still show).
build: setup
	PIP_QUIET=1 $(VENV)/bin/maturin develop --release -q

test-rust:
	cargo test --release --workspace -q

test-python: build
	$(PY) -m pytest -q

# Compiles the CUDA kernel variants with NVRTC for Ampere and Hopper (all cores, through the disk
# cache); fails on an error, a spill, or a table or shared memory that differs from the snapshot.
# Each arch compiles the tile sets it can launch. To keep CI near 10 minutes (two cores, a cold
# cache: all 1247 compiles took 338 s), sm_90a is checked at every head dim of the check set but its
# MASKED variants (about twice a plain one's compile) at 64, 128 and 256 only (the second run finds
# the rest in the disk cache), and sm_80 at 64, 128 and 256 without the MASKED and f32 tensor-core
# (TF32) variants — `make test-kernels-all` checks everything on both.
GOLDEN := tests/golden/kernel_variants.json
BOUNDS := --head-dims 64,128,256
test-kernels: build
	$(PY) -m flash_nif.kernels --arch sm_90a --masked-arch none --golden $(GOLDEN)
	$(PY) -m flash_nif.kernels --arch sm_90a $(BOUNDS) --golden $(GOLDEN)
	$(PY) -m flash_nif.kernels --arch sm_80 $(BOUNDS) --masked-arch none --tf32-arch none --golden $(GOLDEN)

test-kernels-all: build
	$(PY) -m flash_nif.kernels --arch sm_80 --arch sm_90a --golden $(GOLDEN)

# Elixir: Debian's elixir and erlang-dev when mix is missing (as root, else through sudo).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

elixir-setup:
	@command -v mix >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq elixir erlang-dev; }

# `mix test` compiles first: cargo build --release -p flash-nif, library copied to elixir/priv/.
test-elixir: elixir-setup
	cd elixir && mix test

test: setup test-rust test-python test-kernels test-elixir

demo: build
	$(PY) -m flash_nif.train --out runs/demo

bench-cpu: build
	$(PY) bench/cpu.py

bench-gpu: build
	$(PY) bench/gpu.py

clean:
	rm -rf target dist $(VENV) runs elixir/_build elixir/priv/*.so
