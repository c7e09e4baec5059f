"""One background asyncio loop per process, so sync code (the rollout-function contract, Ray actors) can run
coroutines that share long-lived objects (HTTP sessions, semaphores) across calls."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def background_loop() -> asyncio.AbstractEventLoop:
    """The process's background event loop (started on first use, runs in a daemon thread)."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="vime-async", daemon=True).start()
        return _loop


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the background loop and wait for its result (exceptions propagate)."""
    return asyncio.run_coroutine_threadsafe(coro, background_loop()).result()


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Start ``coro`` on the background loop without waiting; ``.result()`` waits (exceptions propagate)."""
    return asyncio.run_coroutine_threadsafe(coro, background_loop())
