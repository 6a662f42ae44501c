# Every target bootstraps .venv from requirements.txt by itself: `make lab` or `make test` on a fresh clone is enough.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup lab test test-gpu html slides release grade bench lint clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; (3, 10) <= v <= (3, 12) or print("warning: FlashLab is tested on Python 3.10-3.12, not", sys.version.split()[0])'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# Jupyter refuses to start as root (containers, some cloud VMs) unless told to.
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

lab: setup
	$(BIN)/jupyter lab $(LAB_ARGS) notebooks/

test: setup
	$(BIN)/python -m pytest -q

test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu

html: setup
	$(BIN)/python -m flashlab html --out build/html

slides: setup
	$(BIN)/python -m flashlab slides --out build/slides

release: setup
	$(BIN)/python -m flashlab release

grade: setup
	$(BIN)/python -m flashlab grade $(or $(SUBMISSIONS),submissions/) --csv grades.csv

bench: setup
	$(BIN)/python -m flashlab bench

lint: setup
	$(BIN)/ruff check flashlab tests

clean:
	rm -rf $(VENV) build
