"""Generation through vllm-router, token-in/token-out: one sample, or a fresh group in one ``n``-sample request,
then the group's hooks and rewards (``--rollout-sample-hook-path``, ``--custom-rm-path`` / ``--rm-type``).

The building blocks of the default rollout (``vime.rollout.vllm_rollout``) and of eval (``eval_rollout``); a custom
generate function (``--custom-generate-function-path``) or rollout function uses :func:`generate`,
:func:`append_response` and :func:`get_context` from here (also importable from ``vime.rollout.vllm_rollout``).

The manager sets ``args.vllm_router_ip/port`` (where requests go), ``args.rollout_engine_urls`` (where
abort/control calls go, never through the router) and ``args.weight_version`` (recorded on each sample as its
request is sent); ``--rollout-sample-seeds`` gives every request its own seed (:func:`sample_seed`).

A failed request is classified by its answer (:meth:`RolloutContext.completion`): vLLM's own refusal (a 4xx with
vLLM's JSON error body, e.g. a prompt longer than the context) marks its samples FAILED with vLLM's reason; router
errors (503 "No available workers (all circuits open or unhealthy)", 500 "Request failed: ..." for a worker
connection, 408/429 from its queue, any 5xx) and lost connections are sent again for a bounded time; a request
unanswered after ``--rollout-request-timeout`` is sent straight to another engine (:func:`_request`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from typing import Any

import aiohttp

from vime.backends.vllm_utils import generate_api
from vime.backends.vllm_utils.control_client import EngineControlClient, EngineControlError
from vime.backends.vllm_utils.routed_experts import apply_choice_routing
from vime.backends.vllm_utils.router import RouterError, list_workers
from vime.rollout.rm_hub import reward_samples
from vime.utils import http_utils
from vime.utils.inflight import records_token_versions
from vime.utils.misc import load_function
from vime.utils.sglang_compat import SamplingParams
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
    """Per-process state shared by ``generate`` calls: HTTP session, concurrency bound, abort flag."""

    def __init__(self, args):
        if args.vllm_router_ip is None:
            raise RolloutError(
                "no router address: the rollout manager sets --vllm-router-ip/--vllm-router-port"
            )
        self.args = args
        self.router_url = f"http://{args.vllm_router_ip}:{args.vllm_router_port}"
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

    async def completion(self, payload: dict[str, Any], engine_url: str | None = None) -> dict[str, Any]:
        """POST ``/v1/completions`` (vLLM's generate route with ``--flush-cache-interval``: ``generate_api``) through
        the router (or straight to ``engine_url``); the decoded answer, as a completion's.

        Raises :class:`SampleGenerationError` when vLLM refused the request (a 4xx with vLLM's error body),
        :class:`RetryableRequestError` on a router error or a lost connection, :class:`RequestTimeoutError` after
        ``--rollout-request-timeout`` (the connection is closed, which aborts the request on its engine), and
        :class:`RolloutError` on any other 4xx (a malformed request: sending it again would not help)."""
        per_token_versions = records_token_versions(self.args)  # vLLM's generate route reports them
        url = f"{engine_url or self.router_url}{generate_api.GENERATE_PATH if per_token_versions else '/v1/completions'}"
        try:
            async with asyncio.timeout(self.request_timeout_s):
                body = generate_api.generate_body(payload) if per_token_versions else payload
                async with self.session.post(url, json=body) as response:
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
            return generate_api.as_completion(json.loads(body)) if per_token_versions else json.loads(body)
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
        return list(getattr(self.args, "rollout_engine_urls", None) or [])

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


def get_context(args) -> RolloutContext:
    """The context for this router and event loop (created on first use)."""
    key = (args.vllm_router_ip, args.vllm_router_port, id(asyncio.get_running_loop()))
    if key not in _contexts:
        _contexts[key] = RolloutContext(args)
    return _contexts[key]


async def close_contexts() -> None:
    """Close every context's HTTP session, and the plug-ins' shared one (:mod:`vime.utils.http_utils`); the rollout
    manager calls this at shutdown."""
    while _contexts:
        _, ctx = _contexts.popitem()
        await ctx.session.close()
    await http_utils.close_session()


def get_model_url(args, model: str, path: str = "/generate") -> str:
    """``http://HOST:PORT{path}`` of the router serving ``model``, a model name of ``--vllm-config`` (slime's
    ``get_model_url``, its default path SGLang's ``/generate``, which :func:`vime.utils.http_utils.post` answers
    through vLLM; without ``--vllm-config`` the policy is named ``policy``). Unlike slime's, an unknown name raises
    rather than falling back to the policy's router."""
    routers = getattr(args, "vllm_model_routers", None) or {}
    if model not in routers:
        raise KeyError(
            f"no model {model!r} is served (models: {sorted(routers)}); name it in --vllm-config, or read the "
            "routers after the rollout manager started the engines"
        )
    host, port = routers[model]
    return f"http://{host}:{port}{path}"


def sampling_params_from_args(args, evaluation: bool = False) -> dict[str, Any]:
    """vLLM request fields for training (``--rollout-*``) or eval (``--eval-*``) sampling."""
    prefix = "eval" if evaluation else "rollout"
    params = {
        "temperature": getattr(args, f"{prefix}_temperature"),
        "top_p": getattr(args, f"{prefix}_top_p"),
        "top_k": getattr(args, f"{prefix}_top_k"),
        "max_tokens": getattr(args, f"{prefix}_max_response_len"),
    }
    if args.use_score_centering and not evaluation:  # the sampler's top-k head of every token, for the loss
        params["logprobs"] = args.score_centering_top_k
    return params | shared_params(args)


def shared_params(args) -> dict[str, Any]:
    """The request fields training and eval share: ``--rollout-stop`` / ``--rollout-stop-token-ids``, and the
    response text's special tokens, kept unless ``--rollout-skip-special-tokens`` (slime's default and SGLang's
    spacing: none added between special tokens)."""
    params: dict[str, Any] = {
        "skip_special_tokens": bool(getattr(args, "rollout_skip_special_tokens", False)),
        "spaces_between_special_tokens": False,
    }
    if args.rollout_stop:
        params["stop"] = args.rollout_stop
    if args.rollout_stop_token_ids:
        params["stop_token_ids"] = args.rollout_stop_token_ids
    return params


def sample_seed(args, sample: Sample) -> int:
    """A per-sample sampling seed: reproducible given ``--rollout-seed`` and the sample's running index."""
    return (args.rollout_seed * 1_000_003 + (sample.index or 0)) % (2**31 - 1)


def _completion_payload(args, prompt: list[int], sampling_params: dict[str, Any], max_tokens: int) -> dict:
    """The ``/v1/completions`` body for token-in/token-out generation with sampled-token log-probs (the
    per-token strings of the log-probs stay token-id placeholders: nothing here reads them, and decoding them
    one by one is a large part of the server's per-token cost)."""
    return {
        "logprobs": 0,  # the sampled token's; score centering's sampling params ask for the top-k as well
        **sampling_params,
        "model": args.hf_checkpoint,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }


def _apply_choice(args, sample: Sample, choice: dict[str, Any], weight_version: int) -> Sample:
    """Append one returned completion choice (tokens, log-probs, text, finish reason and, with
    ``--use-rollout-routing-replay``, the routed experts) to ``sample``, generated from ``weight_version`` on (by
    the versions its ``weight_versions`` spans name, with ``--flush-cache-interval``)."""
    token_ids = choice.get("token_ids") or []
    log_probs = (choice.get("logprobs") or {}).get("token_logprobs") or []
    if len(log_probs) != len(token_ids):
        raise RolloutError(f"engine returned {len(token_ids)} tokens but {len(log_probs)} log-probs")
    top_logprobs = (choice.get("logprobs") or {}).get("top_logprobs")
    if args.use_score_centering and top_logprobs is not None:  # before the tokens: a bad head appends nothing
        if len(top_logprobs) != len(token_ids):
            raise RolloutError(
                f"engine returned {len(token_ids)} tokens but {len(top_logprobs)} top log-probs"
            )
        append_sampler_heads(sample, top_logprobs, args.score_centering_top_k)
    spans, versions = generate_api.token_version_spans(choice, sample.response_length, weight_version)
    append_response(sample, token_ids, log_probs, choice.get("text") or "", trainable=True)
    sample.weight_version_spans += spans
    sample.weight_versions += versions
    sample.status = Status.from_finish_reason(choice.get("finish_reason"))
    has_routing = apply_choice_routing(sample, choice)
    if (
        getattr(args, "use_rollout_routing_replay", False)
        and not has_routing
        and sample.status != Status.ABORTED
    ):
        raise RolloutError(
            "--use-rollout-routing-replay: the engine returned no routed_experts for a finished request; engines "
            "must run with --enable-return-routed-experts (the rollout manager starts them so)"
        )
    return sample


async def _request(
    args, ctx: RolloutContext, payload: dict[str, Any], samples: list[Sample]
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
            version = getattr(args, "weight_version", 0)
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


def max_new_tokens(args, sample: Sample, sampling_params: dict[str, Any]) -> int:
    """Tokens ``sample`` may still generate: ``max_tokens`` minus its response so far, and no more than
    ``--rollout-max-context-len`` minus its length when that is set."""
    remaining = sampling_params["max_tokens"] - sample.response_length
    context = getattr(args, "rollout_max_context_len", None)
    return remaining if context is None else min(remaining, context - len(sample.tokens))


async def generate(args, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Generate (or continue, for a partially generated sample) one response, token-in/token-out."""
    if sample.status in (Status.COMPLETED, Status.TRUNCATED, Status.FAILED):
        return sample
    remaining = max_new_tokens(args, sample, sampling_params)
    if remaining <= 0:
        sample.status = Status.TRUNCATED
        return sample
    payload = _completion_payload(args, sample.tokens, sampling_params, remaining)
    if getattr(args, "rollout_sample_seeds", False):
        payload["seed"] = sample_seed(args, sample)
    response = await _request(args, get_context(args), payload, [sample])
    if response is None:
        return sample
    choices, version = response
    return _apply_choice(args, sample, choices[0], version)


def is_fresh_group(group: list[Sample]) -> bool:
    """Whether a group can be generated by one request with ``n`` samples: every sample still has only its
    prompt (the same for all), and the indices are consecutive (so vLLM's per-child seeds ``seed + i`` are
    the per-sample seeds)."""
    first = group[0]
    return all(
        s.status == Status.PENDING
        and s.response_length == 0
        and s.tokens == first.tokens
        and s.index == (first.index or 0) + i
        for i, s in enumerate(group)
    )


async def generate_fresh_group(args, group: list[Sample], sampling_params: dict[str, Any]) -> list[Sample]:
    """Generate a whole group (:func:`is_fresh_group`) with one request of ``n = len(group)``: one HTTP round trip
    and one prefill for the group instead of one per sample, the same samples as :func:`generate` would draw."""
    remaining = max_new_tokens(args, group[0], sampling_params)
    if remaining <= 0:
        for sample in group:
            sample.status = Status.TRUNCATED
        return group
    payload = _completion_payload(args, group[0].tokens, sampling_params, remaining)
    payload["n"] = len(group)
    if getattr(args, "rollout_sample_seeds", False):
        payload["seed"] = sample_seed(args, group[0])
    response = await _request(args, get_context(args), payload, group)
    if response is not None:
        choices, version = response
        if len(choices) != len(group):
            raise RolloutError(f"engine returned {len(choices)} choices for a request with n={len(group)}")
        for choice in choices:
            _apply_choice(args, group[choice["index"]], choice, version)
    return group


# vLLM's floor for a log-prob (its JSON has no -inf): the padding head of an environment token
_NO_PROBABILITY = -9999.0


def append_sampler_heads(sample: Sample, top_logprobs: list[dict | None], top_k: int) -> None:
    """Append the sampler's ``top_k`` most likely tokens and their log-probs for each new response token to
    ``sample.rollout_topk_token_ids`` / ``rollout_topk_log_probs`` (``--use-score-centering``). ``top_logprobs`` is
    vLLM's completion field: per token a dict ``{"token_id:N": logprob}`` of the top-k plus the sampled token."""
    ids, log_probs = [], []
    for step in top_logprobs:
        best = sorted((step or {}).items(), key=lambda item: -item[1])[:top_k]
        if len(best) < top_k or not all(key.startswith("token_id:") for key, _ in best):
            raise RolloutError(
                f"--use-score-centering: the engine returned {len(best)} top log-probs for a token, expected "
                f"{top_k} as token_id:N (--score-centering-top-k; engines run with --max-logprobs {top_k})"
            )
        ids.append([int(key.removeprefix("token_id:")) for key, _ in best])
        log_probs.append([float(value) for _, value in best])
    _extend_heads(sample, ids, log_probs)


def _extend_heads(sample: Sample, ids: list[list[int]], log_probs: list[list[float]]) -> None:
    if ids:  # a sample records heads once it has one, so a recorded list is never empty
        sample.rollout_topk_token_ids = (sample.rollout_topk_token_ids or []) + ids
        sample.rollout_topk_log_probs = (sample.rollout_topk_log_probs or []) + log_probs


def append_response(
    sample: Sample, token_ids: list[int], log_probs: list[float], text: str, trainable: bool
) -> None:
    """Append generated (``trainable``) or environment/tool tokens (masked out, log-prob 0) to a sample; a sample
    that records the sampler's heads (score centering) gets padding heads for environment tokens."""
    # environment tokens of a sample that records the sampler's heads: zero-probability heads, masked by the loss
    if not trainable and sample.rollout_topk_token_ids is not None:
        top_k = len(sample.rollout_topk_token_ids[0])
        padding = [list(range(top_k))] * len(token_ids)
        _extend_heads(sample, padding, [[_NO_PROBABILITY] * top_k] * len(token_ids))
    sample.append_response_tokens(
        tokens=token_ids, log_probs=log_probs if trainable else None, trainable=trainable, text=text
    )


def reset_to_prompt(sample: Sample) -> Sample:
    """Drop a sample's (partial) response so its prompt can be generated again from scratch."""
    sample.tokens = sample.tokens[: sample.prompt_length]
    sample.response, sample.response_length = "", 0
    sample.loss_mask = sample.rollout_log_probs = sample.reward = sample.rollout_routed_experts = None
    sample.rollout_topk_token_ids = sample.rollout_topk_log_probs = None
    sample.weight_versions, sample.weight_version_spans = [], []
    sample.status, sample.failure_reason = Status.PENDING, None
    return sample


async def generate_group(
    args,
    group: list[Sample],
    sampling_params: dict[str, Any],
    rollout_id: int | None = None,
    evaluation: bool = False,
) -> list[Sample]:
    """Generate every sample of a group (one ``n``-sample request when the group is fresh and no custom generate
    function is set), then reward it (unless the group was aborted). A generate function that returns several
    samples for one (an agent's turns) has them all in the returned group."""
    custom = args.custom_generate_function_path or any(s.generate_function_path for s in group)
    if not custom and is_fresh_group(group):
        samples = await generate_fresh_group(args, group, dict(sampling_params))
        return await _rewarded(args, samples, rollout_id, evaluation)
    if getattr(args, "mask_offpolicy_in_partial_rollout", False):
        for sample in group:
            mask_previous_response(sample)
    outputs = await asyncio.gather(
        *(generate_one(args, sample, sampling_params, evaluation) for sample in group)
    )
    samples = [s for out in outputs for s in (out if isinstance(out, list) else [out])]
    return await _rewarded(args, samples, rollout_id, evaluation)


async def generate_one(
    args, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> Sample | list[Sample]:
    """One sample through its generate function: the sample's own ``generate_function_path`` (slime's per-dataset
    eval setting), else ``--custom-generate-function-path``, else :func:`generate`. The function gets its own copy
    of ``sampling_params`` (readable under SGLang's names too, :class:`~vime.utils.sglang_compat.SamplingParams`),
    and ``evaluation=`` if its signature takes it (as slime passes it)."""
    path = sample.generate_function_path or args.custom_generate_function_path
    generate_fn = load_function(path, "--custom-generate-function-path") if path else generate
    kwargs = {"evaluation": evaluation} if "evaluation" in inspect.signature(generate_fn).parameters else {}
    return await generate_fn(args, sample, SamplingParams(sampling_params), **kwargs)


def mask_previous_response(sample: Sample) -> None:
    """``--mask-offpolicy-in-partial-rollout`` (slime): a partially generated sample that resumes under newer
    weights trains only on the tokens generated from now on; its earlier response tokens get loss mask 0."""
    if sample.response_length and sample.status in (Status.PENDING, Status.ABORTED):
        sample.loss_mask = [0] * sample.response_length


async def _rewarded(
    args, samples: list[Sample], rollout_id: int | None = None, evaluation: bool = False, reward: bool = True
) -> list[Sample]:
    """Reward the samples of a group, unless the group was aborted (it goes back to the buffer); first each
    ``--rollout-sample-hook-path`` hook (slime: ``hook(args, sample, *, rollout_id, evaluation)``, sync or async,
    returning a replacement Sample or None to keep the one it may have changed). As in slime, a sample whose reward
    a custom generate function already set (e.g. a multi-agent system scoring its agents) keeps it. ``reward=False``:
    the hooks only."""
    if any(s.status == Status.ABORTED for s in samples):
        return samples
    for path in getattr(args, "rollout_sample_hook_path", None) or []:
        hook = load_function(path, "--rollout-sample-hook-path")
        for i, sample in enumerate(samples):
            out = hook(args, sample, rollout_id=rollout_id, evaluation=evaluation)
            if inspect.isawaitable(out):
                out = await out
            samples[i] = out if out is not None else sample
    if reward:
        await reward_samples(args, [s for s in samples if s.reward is None])
    return samples


async def generate_and_rm(
    args, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> Sample | list[Sample]:
    """slime's per-sample step (``sglang_rollout.generate_and_rm``): generate one sample with its generate function
    (:func:`generate_one`) and reward what it returns (one sample or several), except with ``--group-rm`` (the group
    is rewarded together). A sample already COMPLETED or TRUNCATED comes back as it is; while the rollout aborts,
    a sample is marked ABORTED without a request."""
    if sample.status in (Status.COMPLETED, Status.TRUNCATED):
        return sample
    if get_context(args).aborting:
        sample.status = Status.ABORTED
        return sample
    if args.partial_rollout and args.mask_offpolicy_in_partial_rollout:
        mask_previous_response(sample)
    out = await generate_one(args, sample, sampling_params, evaluation)
    await _rewarded(args, out if isinstance(out, list) else [out], None, evaluation, reward=not args.group_rm)
    return out


async def generate_and_rm_group(
    args, group: list[Sample], sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Sample]:
    """slime's per-group step (``sglang_rollout.generate_and_rm_group``): generate and reward a group
    (:func:`generate_group`); a group submitted while the rollout aborts comes back untouched."""
    if get_context(args).aborting:
        return group
    return await generate_group(args, group, sampling_params, evaluation=evaluation)
