"""vllm-router: start one (or use an external one) and register the engines with it.

vllm-router 0.1.17 starts with no workers; engines are added with ``POST /workers {"url": ...}``, which
blocks until the router has seen the worker healthy (up to its ``--worker-startup-timeout-secs``, 600 s by
default), so register an engine only once it is ready. Adding a listed worker is an error (HTTP 400), so
:func:`register_workers` skips those. ``DELETE /workers/{url}`` needs the URL percent-encoded (unencoded, the
path is forwarded to a worker) and succeeds for unknown workers too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path

import aiohttp

from vime.backends.vllm_utils.engine import PORT_TAKEN, EngineStartError, ServerProcess, private_port
from vime.utils.misc import free_port
from vime.utils.passthrough_args import passthrough_cli_args

logger = logging.getLogger(__name__)


def router_executable() -> str:
    """The ``vllm-router`` console script of this environment (next to ``sys.executable``), else on PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    if beside.exists():
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise FileNotFoundError(
            f"vllm-router not found next to {sys.executable} or on PATH: pip install vllm-router==0.1.17, "
            "or use an external router with --vllm-router-ip/--vllm-router-port"
        )
    return found


def build_router_command(args: argparse.Namespace, host: str, port: int) -> list[str]:
    """``vllm-router --host H --port P --prometheus-port <free>`` plus the user's ``--router-*`` flags (the
    router's own defaults, e.g. ``--policy cache_aware``, apply to the rest). It starts with no workers.

    The router always serves Prometheus metrics, on port 29000 by default, so a second router on the host
    would die at start; a free port avoids that, and a user's ``--router-prometheus-port`` comes later and wins.
    """
    return [
        router_executable(),
        "--host",
        host,
        "--port",
        str(port),
        "--prometheus-port",
        str(free_port()),
        *passthrough_cli_args(args, "router"),
    ]


class RouterProcess(ServerProcess):
    """A vllm-router process on ``host:port`` (a free port by default); ready when ``/liveness`` answers
    (``/health`` would also report on the workers)."""

    health_path = "/liveness"

    def __init__(
        self,
        args: argparse.Namespace,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
    ):
        port = private_port(host, port)
        super().__init__(
            name="vllm-router",
            command=build_router_command(args, host, port),
            env={**os.environ, **(env or {})},
            host=host,
            port=port,
            log_path=log_path,
            start_timeout=60.0,  # it starts in about a second
        )


def start_router(
    args: argparse.Namespace,
    host: str = "127.0.0.1",
    port: int | None = None,
    log_path: str | Path | None = None,
    tries: int = 3,
) -> RouterProcess:
    """A ready :class:`RouterProcess`. Another process may bind a free port chosen for it (``port``, unless given,
    and its metrics port) before the router does, which then exits at start: it is started again on new free ports,
    up to ``tries`` starts in all; any other start failure raises at once."""
    for attempt in range(1, tries + 1):
        router = RouterProcess(args, host=host, port=port, log_path=log_path).start()
        try:
            router.wait_ready_sync()
            return router
        except EngineStartError as exc:
            if PORT_TAKEN not in str(exc) or attempt == tries:
                raise
        logger.warning(
            "vllm-router lost a port to another process at start; starting it again (%d of %d)",
            attempt + 1,
            tries,
        )


class RouterError(RuntimeError):
    """A worker-management call to the router failed or left the worker list wrong."""


async def _router_call(session: aiohttp.ClientSession, method: str, url: str, **kw) -> dict:
    try:
        async with session.request(method, url, **kw) as resp:
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise RouterError(
            f"vllm-router {method} {url} failed: {exc!r} (a worker is added only once it answers /health)"
        ) from exc
    if resp.status != 200:
        raise RouterError(f"vllm-router {method} {url} failed: HTTP {resp.status}: {text[:300]}")
    return json.loads(text)


async def list_workers(router_url: str, timeout_s: float = 30.0) -> list[str]:
    """The worker URLs registered with the router (``GET /workers``)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        listing = await _router_call(session, "GET", f"{router_url}/workers")
    return [worker["url"] for worker in listing["workers"]]


async def register_workers(router_url: str, engine_urls: Iterable[str], timeout_s: float = 120.0) -> None:
    """Add each ready engine to the router (skipping those already listed), then check all are listed."""
    engine_urls = list(engine_urls)
    listed = set(await list_workers(router_url))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        for url in engine_urls:
            if url not in listed:
                await _router_call(session, "POST", f"{router_url}/workers", json={"url": url})
    listed = set(await list_workers(router_url))
    missing = [url for url in engine_urls if url not in listed]
    if missing:
        raise RouterError(
            f"vllm-router at {router_url} accepted but does not list workers {missing} "
            f"(listed: {sorted(listed)}); see the router log"
        )


async def unregister_worker(router_url: str, engine_url: str, timeout_s: float = 30.0) -> None:
    """Remove one engine from the router (a no-op for an unknown engine)."""
    encoded = urllib.parse.quote(engine_url, safe="")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        await _router_call(session, "DELETE", f"{router_url}/workers/{encoded}")


def connect_router(
    args: argparse.Namespace, log_path: str | Path | None = None
) -> tuple[str, RouterProcess | None]:
    """The router URL and the router process vime started: with ``--vllm-router-ip`` an external router
    (checked reachable, none started); otherwise a new one on 127.0.0.1 and a free port, once ready."""
    if args.vllm_router_ip:
        host = f"[{args.vllm_router_ip}]" if ":" in args.vllm_router_ip else args.vllm_router_ip
        url = f"http://{host}:{args.vllm_router_port}"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            opener.open(f"{url}/liveness", timeout=10).close()
        except OSError as exc:
            raise ConnectionError(
                f"no vllm-router answers at {url} (--vllm-router-ip/--vllm-router-port): {exc}"
            ) from exc
        return url, None
    router = start_router(args, log_path=log_path)
    return router.url, router
