# The two commands of the README. Each creates .venv when it is missing and
# installs what it needs once: the stamp files make a second run skip pip.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test lint bench clean

run: $(VENV)/.installed
	$(BIN)/python examples/parallel_map.py $(ARGS)

# TFSHARD_REQUIRE_GPU=1 make test also installs TensorFlow's CUDA libraries
# (once: its own stamp), and the GPU suite then fails instead of skipping.
GPU_STAMP := $(if $(filter 1,$(TFSHARD_REQUIRE_GPU)),$(VENV)/.installed-cuda)

# The suite runs in WORKERS processes (pytest-xdist), each test file in one of them, so a
# file's module fixtures are made once; WORKERS=0 runs it in this process.
WORKERS ?= 2

test: $(VENV)/.installed-test $(GPU_STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(WORKERS) --dist loadfile $(ARGS)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/scaling.py $(ARGS)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@ $(VENV)/.installed

$(VENV)/.installed-cuda: $(VENV)/.installed-test
	$(BIN)/python -m pip install --quiet 'tensorflow[and-cuda]'
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info
