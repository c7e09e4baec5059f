"""Run an ``aiohttp.web.Application`` on a daemon thread with its own event loop (slime's helper for agent
adapters, which must keep answering while the rollout's loop awaits the agent)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_log import AccessLogger


class FilteredAccessLogger(AccessLogger):
    """An access log of what needs a look: errors and requests slower than ``SLOW_THRESHOLD_SEC`` (HEAD never)."""

    SLOW_THRESHOLD_SEC = 120.0

    def log(self, request, response, time):
        if request.method == "HEAD" or (response.status == 200 and time <= self.SLOW_THRESHOLD_SEC):
            return
        super().log(request, response, time)


@dataclass
class AppHandle:
    """A running app: where it listens, its thread and loop; :meth:`stop` shuts it down."""

    host: str
    port: int
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    runner: web.AppRunner

    def stop(self, timeout: float = 10.0) -> None:
        """Clean the app up on its loop, stop the loop and join the thread."""
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=timeout)


def run_app_in_thread(
    app: web.Application,
    *,
    host: str = "0.0.0.0",
    port: int = 0,
    thread_name: str = "aiohttp-app",
    start_timeout_sec: float = 15.0,
    runner_kwargs: dict[str, Any] | None = None,
) -> AppHandle:
    """Serve ``app`` on ``host:port`` (0: a free port) from a new daemon thread; returns once it listens (an error
    while starting is raised here). ``runner_kwargs`` go to ``web.AppRunner``."""
    ready = threading.Event()
    started: dict[str, Any] = {}

    def serve() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            runner = web.AppRunner(app, **(runner_kwargs or {}))
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, host, port)
            loop.run_until_complete(site.start())
            sockets = site._server.sockets if site._server is not None else ()
            started.update(loop=loop, runner=runner, port=sockets[0].getsockname()[1] if sockets else port)
        except BaseException as exc:
            started["error"] = exc
            return
        finally:
            ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name=thread_name, daemon=True)
    thread.start()
    if not ready.wait(timeout=start_timeout_sec):
        raise TimeoutError(
            f"{thread_name}: the app did not start listening on {host}:{port} in {start_timeout_sec}s"
        )
    if "error" in started:
        raise started["error"]
    return AppHandle(host, int(started["port"]), thread, started["loop"], started["runner"])
