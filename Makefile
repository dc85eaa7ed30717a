# Two entry points for a newcomer: `make demo` and `make test`.
# Both create the virtual environment at .venv on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Parallel workers for the test suite (pytest-xdist); 0 runs in one process.
WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(WORKERS) --dist loadfile

.PHONY: setup demo serve test test-fast lint format typecheck bench lock clean

$(STAMP): pyproject.toml requirements.lock
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m devtools.demo $(ARGS)

serve: $(STAMP)
	$(BIN)/insight-queue serve

# Everything CI runs: lint, format, types, and every test tier.
test: $(STAMP) lint typecheck
	$(PYTEST)

# The quick lane: unit and integration tiers, no real-process scenarios.
test-fast: $(STAMP)
	$(PYTEST) tests/unit tests/integration -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/store.py
	$(BIN)/python benchmarks/cli_startup.py
	$(BIN)/python benchmarks/latency.py

# Re-pin every dependency to what a fresh install picks today.
lock:
	rm -rf .lock-venv
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install --quiet --upgrade pip
	.lock-venv/bin/python -m pip install --quiet '.[dev]'
	.lock-venv/bin/python -m pip freeze --exclude insight-queue > requirements.lock
	rm -rf .lock-venv

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
