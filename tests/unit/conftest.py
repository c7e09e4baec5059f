"""Unit tests run in the same pytest-xdist workers as the e2e tests, whose engines inherit the worker's
environment: a unit test must leave vLLM's variables as it found them (one that left
``VLLM_WORKER_MULTIPROC_METHOD`` set made every CPU engine a later test in that worker started spawn its core)."""

from __future__ import annotations

import os

import pytest


def _vllm_environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key.startswith("VLLM_")}


@pytest.fixture(autouse=True)
def _leaves_vllms_environment_as_found():
    before = _vllm_environment()
    yield
    after = _vllm_environment()
    changed = {key for key in before.keys() | after.keys() if before.get(key) != after.get(key)}
    assert not changed, (
        f"the test left vLLM's environment changed: {sorted(changed)} (before {before}, after {after}); "
        "use monkeypatch.setenv / delenv (set a variable first if it may be absent: delenv of an absent one "
        "restores nothing)"
    )
