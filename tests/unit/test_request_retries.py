"""``--use-fault-tolerance``: a request the router could not complete is sent again until it succeeds (within the
retry window), and its samples count once in ``fault/requeued_samples`` however many tries it takes."""

from __future__ import annotations

import asyncio
import types

import pytest

from vime.rollout import vllm_generate
from vime.rollout.vllm_generate import RolloutError, _request
from vime.utils.types import Sample


class FlakyRouter:
    """A rollout context whose router fails the first ``failures`` completions."""

    def __init__(self, failures: int, retry_window_s: float = 600.0):
        self.failures = failures
        self.calls = 0
        self.semaphore = asyncio.Semaphore(1)
        self.aborting = False
        self.retry_window_s = retry_window_s
        self.requeued_samples = 0

    async def completion(self, payload):
        self.calls += 1
        if self.calls <= self.failures:
            raise RolloutError("router: connection reset (engine died)")
        return {"choices": [{"index": 0}, {"index": 1}]}


@pytest.fixture(autouse=True)
def no_retry_pause(monkeypatch):
    real_sleep = asyncio.sleep
    monkeypatch.setattr(vllm_generate.asyncio, "sleep", lambda _s: real_sleep(0))


def test_samples_of_a_retried_request_count_once():
    args = types.SimpleNamespace(weight_version=3)
    ctx = FlakyRouter(failures=3)
    choices, version = asyncio.run(_request(args, ctx, {}, [Sample(index=0), Sample(index=1)]))
    assert ctx.calls == 4 and len(choices) == 2 and version == 3
    assert ctx.requeued_samples == 2


def test_a_request_still_failing_after_the_window_ends_the_rollout():
    ctx = FlakyRouter(failures=10**9, retry_window_s=0.0)
    with pytest.raises(RolloutError, match="connection reset"):
        asyncio.run(_request(types.SimpleNamespace(weight_version=0), ctx, {}, [Sample(index=0)]))
    assert ctx.calls == 1
