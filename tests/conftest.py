"""Per-file cost of the e2e tests, printed at the end of the run: wall time, and how many vLLM engines started
(a poller records every engine API-server process it sees, whoever started it: a fixture, the pool, or a
train.py run's Ray actors)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import psutil
import pytest

ENGINE_COMMAND = "vllm.entrypoints.openai.api_server"


class EngineCounter:
    """Polls the process table; each engine API server seen counts once, for the test file running then."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.current_file: str | None = None
        self.seen: set[tuple[int, float]] = set()  # (pid, create_time): a pid may be reused
        self.per_file: dict[str, int] = defaultdict(int)
        self.wall_s: dict[str, float] = defaultdict(float)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="engine-counter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._scan()

    def _scan(self) -> None:
        for proc in psutil.process_iter(["cmdline", "create_time"]):
            try:
                cmdline = proc.info["cmdline"] or []
                if cmdline[1:3] == ["-m", ENGINE_COMMAND]:  # the server itself (not its process guard)
                    key = (proc.pid, proc.info["create_time"])
                    if key not in self.seen:
                        self.seen.add(key)
                        self.per_file[self.current_file or "(between tests)"] += 1
            except psutil.Error:
                pass

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._scan()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[COUNTER] = EngineCounter()
    config.stash[COUNTER].start()


COUNTER = pytest.StashKey[EngineCounter]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    counter = item.config.stash[COUNTER]
    counter.current_file = item.location[0]
    started = time.monotonic()
    yield
    counter.wall_s[item.location[0]] += time.monotonic() - started


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    counter = config.stash[COUNTER]
    counter.stop()
    files = sorted(f for f in counter.wall_s if "/e2e/" in f or counter.per_file.get(f))
    if not files:
        return
    terminalreporter.section("e2e cost per file")
    for name in files:
        terminalreporter.write_line(
            f"{counter.wall_s[name]:8.1f} s  {counter.per_file.get(name, 0):3d} engine(s)  {name}"
        )
    total = sum(counter.wall_s[f] for f in files)
    terminalreporter.write_line(f"{total:8.1f} s  {sum(counter.per_file.values()):3d} engine(s)  in all")
