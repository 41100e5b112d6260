# Two commands do everything on a fresh machine:
#   make compare   installs into .venv and runs the main job (memconv compare)
#   make test      installs into .venv and runs the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install compare test test-slow lint format

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test,peers,plot,dev]"
	touch $@

install: $(VENV)/.installed

compare: install
	$(BIN)/memconv compare

test: install
	$(BIN)/python -m pytest -q

test-slow: install
	$(BIN)/python -m pytest -q -m slow

lint: install
	$(BIN)/ruff check memconv tests examples
	$(BIN)/ruff format --check memconv tests examples

format: install
	$(BIN)/ruff format memconv tests examples
	$(BIN)/ruff check --fix memconv tests examples
