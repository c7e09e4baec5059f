"""The rollout's HTTP side: requests through vllm-router (or straight to an engine), their failures and retries,
and aborting every engine's requests.

A failed request is classified by its answer (:meth:`RolloutContext.completion`): vLLM's own refusal (a 4xx with
vLLM's JSON error body, e.g. a prompt longer than the context) marks its samples FAILED with vLLM's reason; router
errors (503 "No available workers (all circuits open or unhealthy)", 500 "Request failed: ..." for a worker
connection, 408/429 from its queue, any 5xx) and lost connections are sent again for a bounded time; a request
unanswered after ``--rollout-request-timeout`` is sent straight to another engine (:func:`request`).

Where requests go and where abort calls go (the engines, never through the router) is the run's
:class:`~vime.utils.run_context.RunContext`; :func:`request` stamps each request with the weight version the engines
serve when it is sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp

from vime.backends.vllm_utils import generate_api
from vime.backends.vllm_utils.control_client import EngineControlClient, EngineControlError
from vime.backends.vllm_utils.router import RouterError, list_workers
from vime.utils import http_utils
from vime.utils.inflight import records_token_versions
from vime.utils.run_context import RunContext, run_context_of
from vime.utils.types import Sample, Status

logger = logging.getLogger(__name__)


class RolloutError(RuntimeError):
    """The rollout cannot go on (router or engines unreachable, filter never satisfied...)."""


class SampleGenerationError(RuntimeError):
    """vLLM refused one request (a 4xx with its error body): the samples are marked FAILED and the batch goes on."""


class RetryableRequestError(RolloutError):
    """The router or the connection failed a request (no worker, circuit open, queue full, 5xx, connection lost):
    sent again until the retry window ends, then the rollout fails with this reason."""


class RequestTimeoutError(RolloutError):
    """No answer within ``--rollout-request-timeout``: the request is sent straight to another engine."""


# Without --use-fault-tolerance a router error is retried this long (a worker dropping out, a full queue).
ROUTER_ERROR_RETRY_S = 60.0
RETRY_PAUSE_S = 1.0
# Router answers that say nothing about the request itself: its queue timed out (408) or was full (429).
_ROUTER_QUEUE_STATUSES = (408, 429)


def vllm_error_message(body: str) -> str | None:
    """``"<type>: <message>"`` of vLLM's error body ``{"error": {"message", "type", "param", "code"}}``; None for
    any other body (the router's own errors are plain text)."""
    try:
        error = json.loads(body).get("error")
    except (json.JSONDecodeError, AttributeError):
        return None
    if not isinstance(error, dict) or "message" not in error:
        return None
    return f"{error.get('type', 'error')}: {error['message']}"


class RolloutContext:
    """HTTP state shared by the requests of one run on one event loop: session, concurrency bound, abort flag."""

    def __init__(self, args, run_context: RunContext):
        if run_context.router_ip is None:
            raise RolloutError("no router address: the rollout manager starts (or is given) the router first")
        self.run = run_context
        self.router_url = run_context.router_url
        concurrency = args.rollout_concurrency * max(1, len(self.engine_urls))
        self.semaphore = asyncio.Semaphore(concurrency)
        connector = aiohttp.TCPConnector(limit=concurrency)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        self.aborting = False
        self.request_timeout_s = args.rollout_request_timeout
        self.fault_tolerant = args.use_fault_tolerance
        # a request the router could not complete is sent again for this long; with --use-fault-tolerance long
        # enough for a dead engine to be replaced
        self.retry_window_s = (
            args.engine_start_timeout
            + args.rollout_health_check_interval
            + args.rollout_health_check_timeout
            + 60
            if self.fault_tolerant
            else ROUTER_ERROR_RETRY_S
        )
        self.requeued_samples = 0
        self.per_token_versions = records_token_versions(args)  # vLLM's generate route reports them

    async def completion(self, payload: dict[str, Any], engine_url: str | None = None) -> dict[str, Any]:
        """POST ``/v1/completions`` (vLLM's generate route with ``--flush-cache-interval``: ``generate_api``) through
        the router (or straight to ``engine_url``); the decoded answer, as a completion's.

        Raises :class:`SampleGenerationError` when vLLM refused the request (a 4xx with vLLM's error body),
        :class:`RetryableRequestError` on a router error or a lost connection, :class:`RequestTimeoutError` after
        ``--rollout-request-timeout`` (the connection is closed, which aborts the request on its engine), and
        :class:`RolloutError` on any other 4xx (a malformed request: sending it again would not help)."""
        path = generate_api.GENERATE_PATH if self.per_token_versions else "/v1/completions"
        url = f"{engine_url or self.router_url}{path}"
        sent = generate_api.generate_body(payload) if self.per_token_versions else payload
        try:
            async with asyncio.timeout(self.request_timeout_s):
                async with self.session.post(url, json=sent) as response:
                    body = await response.text()
        except TimeoutError as exc:
            raise RequestTimeoutError(
                f"no answer from {url} within --rollout-request-timeout {self.request_timeout_s:g} s"
            ) from exc
        except aiohttp.ClientError as exc:
            where = "the router" if engine_url is None else "the engine"
            raise RetryableRequestError(f"lost {where} at {url} ({type(exc).__name__}: {exc})") from exc
        status = response.status
        if status < 400:
            answer = json.loads(body)
            return generate_api.as_completion(answer) if self.per_token_versions else answer
        vllm_reason = vllm_error_message(body)
        if status < 500 and status not in _ROUTER_QUEUE_STATUSES:
            if vllm_reason is not None:
                raise SampleGenerationError(f"vLLM refused the request (HTTP {status}) {vllm_reason}")
            raise RolloutError(f"{url} refused the request: HTTP {status}: {body[:300]}")
        raise RetryableRequestError(
            f"{url} answered HTTP {status}: {(vllm_reason or body)[:300] or '(no body)'}"
        )

    async def engine_for_resend(self, timeout: RequestTimeoutError, timed_out_on: set[str]) -> str:
        """Where to send a request again after ``timeout``: the first of the router's workers, other than
        ``timed_out_on``, to answer ``GET /health`` (within 5 s). The router's list, not the engine URLs: it holds
        only engines that serve the current weights, and an external router's workers too. Raises
        :class:`RolloutError` with the reason when there is none."""
        try:
            urls = [url for url in await list_workers(self.router_url) if url not in timed_out_on]
        except RouterError as exc:
            raise RolloutError(f"{timeout}, and {exc}") from timeout
        clients = [EngineControlClient(url) for url in urls]

        async def probe(client: EngineControlClient) -> str | None:
            return client.base_url if await client.health() else None

        probes = [asyncio.ensure_future(probe(client)) for client in clients]
        try:
            for answer in asyncio.as_completed(probes):
                if (url := await answer) is not None:
                    return url
        finally:
            for task in probes:
                task.cancel()
            await asyncio.gather(*probes, return_exceptions=True)
            await asyncio.gather(*(client.close() for client in clients))
        raise RolloutError(
            f"{timeout}, and no other worker of the router answers /health (workers: {urls}; timed out on: "
            f"{sorted(timed_out_on) or 'the router'}); raise --rollout-request-timeout if the engines are only slow"
        ) from timeout

    @property
    def engine_urls(self) -> list[str]:
        """The engines now (``--use-fault-tolerance`` replaces dead ones, on new ports)."""
        return list(self.run.engine_urls)

    async def abort_all(self) -> None:
        """Abort every in-flight request on every engine (``/pause?mode=abort``), then resume them. With
        ``--use-fault-tolerance`` an engine that does not answer is skipped: dead, it has nothing left to abort (its
        requests come back through the retry path)."""
        clients = [EngineControlClient(url) for url in self.engine_urls]
        live = clients
        try:
            for call in (lambda client: client.pause(mode="abort"), lambda client: client.resume()):
                results = await asyncio.gather(*(call(client) for client in live), return_exceptions=True)
                for result in results:
                    if isinstance(result, BaseException) and not (
                        self.fault_tolerant and isinstance(result, EngineControlError)
                    ):
                        raise result
                live = [
                    c
                    for c, result in zip(live, results, strict=True)
                    if not isinstance(result, BaseException)
                ]
        finally:
            await asyncio.gather(*(client.close() for client in clients))


_contexts: dict[tuple, RolloutContext] = {}


def get_context(args, *, run_context: RunContext | None = None) -> RolloutContext:
    """The context of this run (``run_context``, else the one behind the view a plug-in was handed as ``args``) and
    event loop, created on first use."""
    run_context = run_context_of(args, run_context)
    key = (id(run_context), id(asyncio.get_running_loop()))
    if key not in _contexts:
        _contexts[key] = RolloutContext(args, run_context)
    return _contexts[key]


async def close_contexts() -> None:
    """Close every context's HTTP session, and the plug-ins' shared one (:mod:`vime.utils.http_utils`); the rollout
    manager calls this at shutdown."""
    while _contexts:
        _, ctx = _contexts.popitem()
        await ctx.session.close()
    await http_utils.close_session()


async def request(
    ctx: RolloutContext, payload: dict[str, Any], samples: list[Sample]
) -> tuple[list[dict], int] | None:
    """POST one completion request for ``samples`` (bounded by the concurrency limit): its choices and the weight
    version the engines served when it was sent; None if it did not run: the rollout is aborting (samples marked
    ABORTED) or vLLM refused it (samples marked FAILED with vLLM's reason).

    A router error or a lost connection is sent again, through the router, until ``ctx.retry_window_s`` after its
    first failure. A request unanswered after ``--rollout-request-timeout`` is sent straight to a worker of the
    router that answers ``/health`` and has not timed out on it (the router's cache-aware policy would send the same
    prompt back to the hung engine); when none is left the rollout fails. Either way the samples are unchanged (a
    failed attempt appends nothing), so each is generated once.

    The version is read when the request is sent, not when it returns: a weight sync while it runs pauses the
    engines in place and resumes them on the new weights, so its first tokens come from the older version (a
    request sent while a sync is under way counts as the older version too: a conservative stamp). With
    ``--flush-cache-interval`` the engines report the version of each token instead."""
    async with ctx.semaphore:
        give_up_at = None
        engine_url = None  # through the router until a timeout
        timed_out_on: set[str] = set()
        while True:
            if ctx.aborting:
                for sample in samples:
                    sample.status = Status.ABORTED
                return None
            version = ctx.run.weight_version
            try:
                return (await ctx.completion(payload, engine_url))["choices"], version
            except SampleGenerationError as exc:
                logger.warning("%d sample(s) FAILED: %s", len(samples), exc)
                for sample in samples:
                    sample.mark_failed(str(exc))
                    sample.remove_sample = True
                return None
            except (RequestTimeoutError, RetryableRequestError) as exc:
                first_failure = give_up_at is None
                if first_failure:  # counted once, however many tries it takes
                    give_up_at = time.monotonic() + ctx.retry_window_s
                    ctx.requeued_samples += len(samples)
                if isinstance(exc, RequestTimeoutError):
                    if engine_url is not None:
                        timed_out_on.add(engine_url)
                    engine_url = await ctx.engine_for_resend(exc, timed_out_on)
                    logger.warning("%s; sending it straight to %s", exc, engine_url)
                    continue
                if time.monotonic() >= give_up_at:
                    raise RetryableRequestError(
                        f"{exc}; still failing {ctx.retry_window_s:g} s after the first try"
                    ) from exc
                (logger.warning if first_failure else logger.debug)(
                    "request for %d sample(s) failed (%s); sending it again for up to %g s",
                    len(samples), exc, ctx.retry_window_s,
                )  # fmt: skip
                engine_url = None
                await asyncio.sleep(RETRY_PAUSE_S)
