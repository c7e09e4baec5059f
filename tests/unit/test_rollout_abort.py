"""Aborting surplus requests on every engine (over-sampling): with ``--use-fault-tolerance`` an engine that died (or
was just replaced) does not fail the rollout, and the abort reaches the engines as they are now."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from vime.backends.vllm_utils.control_client import EngineControlError
from vime.rollout import router_client
from vime.utils.run_context import RunContext

CALLS: list[tuple[str, str]] = []


class FakeClient:
    def __init__(self, url):
        self.url = url

    async def pause(self, mode):
        if "dead" in self.url:
            raise EngineControlError("pause", self.url, None, "refused")
        CALLS.append(("pause", self.url))

    async def resume(self):
        CALLS.append(("resume", self.url))

    async def close(self):
        CALLS.append(("close", self.url))


def _abort(fault_tolerance: bool, urls: list[str]) -> None:
    args = argparse.Namespace(
        rollout_concurrency=4, use_fault_tolerance=fault_tolerance, engine_start_timeout=1.0,
        rollout_health_check_interval=1.0, rollout_health_check_timeout=1.0, rollout_request_timeout=1800.0,
        flush_cache_interval=None,
    )  # fmt: skip
    run = RunContext(router_ip="127.0.0.1", router_port=1, engine_urls=urls)

    async def main():
        ctx = router_client.RolloutContext(args, run)
        try:
            run.engine_urls = [*urls, "http://new"]  # an engine replaced since the context was made
            await ctx.abort_all()
        finally:
            await ctx.session.close()

    asyncio.run(main())


def test_a_dead_engine_is_skipped_only_with_fault_tolerance(monkeypatch):
    monkeypatch.setattr(router_client, "EngineControlClient", FakeClient)
    CALLS.clear()
    _abort(True, ["http://e0", "http://dead"])
    assert [c for c in CALLS if c[0] != "close"] == [
        ("pause", "http://e0"), ("pause", "http://new"), ("resume", "http://e0"), ("resume", "http://new")
    ]  # fmt: skip
    assert {url for kind, url in CALLS if kind == "close"} == {"http://e0", "http://dead", "http://new"}
    with pytest.raises(EngineControlError, match="dead"):
        _abort(False, ["http://e0", "http://dead"])
