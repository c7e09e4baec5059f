# vime on a CPU machine: `make quickstart` (install + main job), `make test` (install + all CPU tests).
VENV ?= .venv
PY := $(VENV)/bin/python
LINT_PATHS := $(wildcard vime tests tools examples bench train.py train_async.py)
export VIME_SHARED_DIR ?= $(abspath ../shared)

.PHONY: install quickstart test test-unit test-e2e lint

$(VENV)/.installed: pyproject.toml scripts/install.sh
	VENV=$(VENV) bash scripts/install.sh
	touch $@

install: $(VENV)/.installed

quickstart: install
	$(PY) examples/quickstart/quickstart.py

# VIME_REQUIRE_ENGINES=1: a missing vLLM, vllm-router or Ray fails the e2e tests (a bare pytest skips them)
test: install lint
	VIME_REQUIRE_ENGINES=1 $(PY) -m pytest tests -q --timeout 900 --durations=30

test-unit: install
	$(PY) -m pytest tests/unit -q

test-e2e: install
	VIME_REQUIRE_ENGINES=1 $(PY) -m pytest tests/e2e -q --timeout 900

lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
