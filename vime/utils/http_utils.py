"""The HTTP helpers slime plug-ins import (``from slime.utils.http_utils import post`` becomes
``from vime.utils.http_utils import post``): JSON ``post`` with retries and ``get``, over one shared aiohttp
session per event loop, never through an HTTP proxy (the calls stay inside the cluster). An SGLang ``/generate``
request is answered by vLLM (:mod:`vime.utils.sglang_compat`); :func:`get_rollout_num_engines` is slime's."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

from vime.utils import sglang_compat
from vime.utils.run_context import PluginArgs

logger = logging.getLogger(__name__)
_sessions: dict[int, aiohttp.ClientSession] = {}


def _session() -> aiohttp.ClientSession:
    """This event loop's shared session (created on first use, no total timeout, no proxy from the environment)."""
    key = id(asyncio.get_running_loop())
    session = _sessions.get(key)
    if session is None or session.closed:
        connector = aiohttp.TCPConnector(limit=0)
        session = _sessions[key] = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None), trust_env=False
        )
    return session


def _decode(body: bytes) -> Any:
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body.decode(errors="replace")


# Client errors that may pass on their own (timeout, rate limit); other 4xx answers are final.
_RETRIED_CLIENT_ERRORS = (408, 429)


class RequestRefusedError(aiohttp.ClientResponseError):
    """The server refused the request with a client error (4xx): sending it again would not help."""


async def post(url: str, payload: dict | None, max_retries: int = 60, headers: dict | None = None) -> Any:
    """POST ``payload`` as JSON; the decoded JSON answer (text if it is not JSON). Connection errors, server errors
    (5xx), 408 and 429 are retried once a second, up to ``max_retries`` attempts, and the last error is raised;
    other client errors (4xx) raise :class:`RequestRefusedError` at once.

    An SGLang ``/generate`` request (the URL's path ends in ``/generate`` and the body has ``input_ids`` or
    ``text``), as slime's plug-ins send to the router, goes to ``/v1/completions`` on the same host and its answer
    comes back in SGLang's shape (:mod:`vime.utils.sglang_compat`); with ``n`` > 1, a list of answers."""
    if not sglang_compat.is_sglang_generate(url, payload):
        return await _post_json(url, payload, max_retries, headers)
    request, score_only = sglang_compat.vllm_request(payload)
    response = await _post_json(sglang_compat.completions_url(url), request, max_retries, headers)
    outputs = [
        sglang_compat.sglang_output(response, choice, payload, score_only) for choice in response["choices"]
    ]
    return outputs[0] if len(outputs) == 1 else outputs


async def _post_json(url: str, payload: dict | None, max_retries: int, headers: dict | None) -> Any:
    for attempt in range(1, max_retries + 1):
        try:
            async with _session().post(url, json=payload or {}, headers=headers) as response:
                body = await response.read()
                if response.status >= 400:
                    message = body[:300].decode(errors="replace")
                    refused = 400 <= response.status < 500 and response.status not in _RETRIED_CLIENT_ERRORS
                    error = RequestRefusedError if refused else aiohttp.ClientResponseError
                    raise error(response.request_info, (), status=response.status, message=message)
                return _decode(body)
        except RequestRefusedError:
            raise
        except (TimeoutError, aiohttp.ClientError) as exc:
            if attempt == max_retries:
                raise
            logger.info("POST %s failed (%s); retry %d of %d", url, exc, attempt, max_retries - 1)
            await asyncio.sleep(1)
    raise ValueError(f"max_retries must be >= 1, not {max_retries}")


def get_rollout_num_engines(args) -> int:
    """How many policy engines serve the rollout (slime's helper, e.g. for ``--sglang-server-concurrency`` times
    engines): the live engines in the ``args`` a rollout hands its plug-ins, else what the flags give
    (``--rollout-external-engine-addrs``, or ``--rollout-num-gpus`` / ``--rollout-num-gpus-per-engine``)."""
    if isinstance(args, PluginArgs) and args.rollout_engine_urls:  # a rollout's view: the engines now
        return len(args.rollout_engine_urls)
    if args.rollout_external_engine_addrs:
        return len(args.rollout_external_engine_addrs)
    if not args.rollout_num_gpus:
        return 0
    return max(1, args.rollout_num_gpus // args.rollout_num_gpus_per_engine)


async def close_session() -> None:
    """Close this event loop's shared session (the rollout manager does at shutdown)."""
    session = _sessions.pop(id(asyncio.get_running_loop()), None)
    if session is not None:
        await session.close()


async def get(url: str) -> Any:
    """GET ``url``; the decoded JSON answer (HTTP errors raise)."""
    async with _session().get(url) as response:
        response.raise_for_status()
        return _decode(await response.read())
