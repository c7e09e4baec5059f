"""``cuda_available`` answers as ``torch.cuda.is_available()`` does, without torch for a CPU-only build."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from vime.utils import cuda_check


@pytest.fixture(autouse=True)
def _fresh_answer():
    cuda_check.cuda_available.cache_clear()
    yield
    cuda_check.cuda_available.cache_clear()


def test_a_cpu_build_of_torch_has_no_cuda_without_asking_torch(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.13.0+cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("torch was asked"))
    assert cuda_check.cuda_available() is False


@pytest.mark.parametrize("answer", [True, False])
def test_any_other_build_asks_torch(monkeypatch, answer):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.11.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: answer)
    assert cuda_check.cuda_available() is answer


def test_this_install_answers_as_torch_does():
    assert cuda_check.cuda_available() == torch.cuda.is_available()
