# Every target bootstraps .venv by itself: `make lab` or `make test` on a fresh clone is enough.
# `make lab` installs what a student needs (requirements.txt); test, lint, html and slides add the contributor
# tooling (requirements-dev.txt) on top.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DEV_STAMP := $(VENV)/.installed-dev-stamp

.PHONY: setup dev lab test test-gpu html slides release grade bench bench8 lint clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; (3, 10) <= v <= (3, 12) or print("warning: FlashLab is tested on Python 3.10-3.12, not", sys.version.split()[0])'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

dev: $(DEV_STAMP)

$(DEV_STAMP): $(STAMP) requirements-dev.txt
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	touch $(DEV_STAMP)

# Jupyter refuses to start as root (containers, some cloud VMs) unless told to.
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

lab: setup
	$(BIN)/jupyter lab $(LAB_ARGS) notebooks/

test: dev
	$(BIN)/python -m pytest -q

test-gpu: dev
	$(BIN)/python -m pytest -q -m gpu

html: dev
	$(BIN)/python -m flashlab html --out build/html

slides: dev
	$(BIN)/python -m flashlab slides --out build/slides

release: setup
	$(BIN)/python -m flashlab release

grade: setup
	$(BIN)/python -m flashlab grade $(or $(SUBMISSIONS),submissions/) --csv grades.csv

bench: setup
	$(BIN)/python -m flashlab bench

# Chapter 8's recorded runs (data/ch8/), as recorded on the H200; then put the new kernels under the sanitizers.
bench8: setup
	$(BIN)/python -m flashlab.gpu.bench8 bwd --n 4096 16384 --causal no --repeat 20 --warmup 3 \
	    --impls sdpa_flash ours_pipe ours_mma sdpa_cudnn
	$(BIN)/python -m flashlab.gpu.bench8 decode --m 65536 --splits 4 16 20 41 64 128 256 --repeat 20 --warmup 3
	$(BIN)/python -m flashlab.gpu.bench8 memory --n 1024 4096 16384
	$(BIN)/python -m flashlab.gpu.bench8 train --steps 400
	compute-sanitizer --tool memcheck $(BIN)/python -m flashlab.gpu.bench8 selfcheck
	compute-sanitizer --tool racecheck $(BIN)/python -m flashlab.gpu.bench8 selfcheck

lint: dev
	$(BIN)/ruff check flashlab tests

clean:
	rm -rf $(VENV) build
