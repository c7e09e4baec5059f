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

# VIME_REQUIRE_ENGINES=1: a missing vLLM, vllm-router or Ray fails the e2e tests (a bare pytest skips them).
# TEST_WORKERS pytest-xdist workers, each taking whole files, longest first (tests/conftest.py): the e2e tests
# leave a core idle much of the time (one process importing, starting or waiting), so two share two cores well.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: install lint
	VIME_REQUIRE_ENGINES=1 $(PY) -m pytest tests -q --timeout 900 --durations=30 $(XDIST)

test-unit: install
	$(PY) -m pytest tests/unit -q

test-e2e: install
	VIME_REQUIRE_ENGINES=1 $(PY) -m pytest tests/e2e -q --timeout 900 $(XDIST)

lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
