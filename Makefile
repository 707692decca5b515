# The two commands of the README:
#   make run    compile the example ops to .cubin with IR dumps and check them (GPU if present, else the emulator)
#   make test   the test suite (layer contracts and mypy --strict on tecc/ir first)
#   make fuzz   the differential fuzzer's long profile (tests/test_fuzz_programs.py; FUZZ_EXAMPLES per test)
# Both create the virtual environment and install everything on a fresh machine.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch for the PyTorch layer (tc.torch, the torch.compile backend), which the tests run in the
# emulator: a CPU build is enough, and this release is the one the suite is verified on
TORCH  ?= torch==2.13.0

.PHONY: setup run test fuzz clean

FUZZ_EXAMPLES ?= 2000

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,torch]" "$(TORCH)"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/tecc check examples --dump-ir dumps -o out

test: setup
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy --strict --follow-imports=silent tecc/ir
	$(PY) -m pytest -q

# fresh random programs each run (the CI profile replays a fixed short set); a failure prints the
# program and a @reproduce_failure line, and hypothesis keeps it in .hypothesis/ to replay first
fuzz: setup
	TECC_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) HYPOTHESIS_PROFILE=dev $(PY) -m pytest -q tests/test_fuzz_programs.py \
		--hypothesis-show-statistics

clean:
	rm -rf dumps out build .pytest_cache
