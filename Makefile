# The two commands of the README:
#   make run    compile the example ops to .cubin with IR dumps and check them (GPU if present, else the emulator)
#   make test   the test suite (layer contracts and mypy --strict on tecc/ir first)
# Both create the virtual environment and install everything on a fresh machine.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: setup run test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/tecc check examples --dump-ir dumps -o out

test: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy --strict --follow-imports=silent tecc/ir
	$(PY) -m pytest -q

clean:
	rm -rf dumps out build .pytest_cache
