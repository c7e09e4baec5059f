"""Per-file cost of the e2e tests, printed at the end of the run: wall time, and how many vLLM engines started
(a poller records every engine API-server process it sees, whoever started it: a fixture, the pool, or a
train.py run's Ray actors).

Under pytest-xdist (``make test`` runs two workers) each worker tags its environment with its id, which every
process it starts inherits (engines, Ray, train.py runs); a worker counts only the engines carrying its tag, and
sends its figures to the controller, which prints them."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict

import psutil
import pytest

from vime.backends.vllm_utils import fork_server
from vime.backends.vllm_utils.engine import SERVER_MODULES

WORKER_ENV = "VIME_TEST_WORKER"


class EngineCounter:
    """Polls the process table; each engine API server seen counts once, for the test file running then."""

    def __init__(self, worker: str | None, interval_s: float = 1.0):
        self.worker = worker
        self.interval_s = interval_s
        self.current_file: str | None = None
        self.seen: set[tuple[int, float]] = set()  # (group, its leader's create_time): a pid may be reused
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

    def _mine(self, proc: psutil.Process) -> bool:
        return self.worker is None or fork_server.environ_of(proc).get(WORKER_ENV) == self.worker

    def _scan(self) -> None:
        # asked of each process, not through process_iter(attrs): psutil shares its Process objects between threads'
        # process_iter calls, so another thread's call (a fault script's) can replace ``proc.info`` meanwhile
        for proc in psutil.process_iter():
            try:
                cmdline = fork_server.command_of(proc)
                # the server itself (not its process guard)
                if (
                    cmdline[1:2] == ["-m"]
                    and cmdline[2:3]
                    and cmdline[2] in SERVER_MODULES
                    and self._mine(proc)
                ):
                    # one engine, one process group (its guard's): its engine core starts under the server's name
                    group = os.getpgid(proc.pid)
                    key = (group, psutil.Process(group).create_time())
                    if key not in self.seen:
                        self.seen.add(key)
                        self.per_file[self.current_file or "(between tests)"] += 1
            except (psutil.Error, ProcessLookupError):
                pass

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._scan()

    def figures(self) -> dict[str, dict[str, float]]:
        """``{"wall_s": {file: s}, "engines": {file: n}}``."""
        return {"wall_s": dict(self.wall_s), "engines": dict(self.per_file)}


# Run order under xdist (``--dist loadfile --no-loadscope-reorder``: a file stays on one worker, files go out in
# this order): the longest e2e files first, so the two workers finish together; then the rest as collected.
# The costs (s) are this summary's, on the 2-core machine; a stale list only costs balance, never correctness.
LONGEST_FIRST = {  # seconds per file in the last clean-clone CI (2 cores, 2 workers), adjusted for later cuts
    "test_fault_tolerance.py": 780,
    "test_loop_learns.py": 320,  # its runs side by side
    "test_model_families.py": 300,
    "test_slime_examples.py": 260,
    "test_several_models.py": 255,
    "test_two_node_cluster.py": 205,
    "test_ray_cluster.py": 195,
    "test_resume_after_kill.py": 175,
    "test_sft.py": 140,
    "test_example_train.py": 130,
    "test_train_debug_rollout.py": 125,
    "test_engine_router.py": 115,
    "test_train_loop.py": 110,
    "test_train_modes.py": 90,
    "test_moe_routing.py": 75,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: -LONGEST_FIRST.get(item.path.name, 0))  # stable: the rest keep their order


COUNTER = pytest.StashKey[EngineCounter]()
FROM_WORKERS = pytest.StashKey[list[dict]]()


def pytest_configure(config: pytest.Config) -> None:
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker is not None:
        os.environ[WORKER_ENV] = worker
    config.stash[COUNTER] = EngineCounter(worker)
    config.stash[COUNTER].start()
    config.stash[FROM_WORKERS] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    counter = item.config.stash[COUNTER]
    counter.current_file = item.location[0]
    started = time.monotonic()
    yield
    counter.wall_s[item.location[0]] += time.monotonic() - started


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the figures to the controller
        counter = session.config.stash[COUNTER]
        counter.stop()
        session.config.workeroutput["e2e_cost"] = json.dumps(counter.figures())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """xdist's controller: a worker's figures."""
    if figures := getattr(node, "workeroutput", {}).get("e2e_cost"):
        node.config.stash[FROM_WORKERS].append(json.loads(figures))


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    counter = config.stash[COUNTER]
    counter.stop()
    wall_s: dict[str, float] = defaultdict(float)
    engines: dict[str, int] = defaultdict(int)
    # under xdist the workers ran the tests (the controller's own poller saw every worker's engines)
    for figures in config.stash[FROM_WORKERS] or [counter.figures()]:
        for name, seconds in figures["wall_s"].items():
            wall_s[name] += seconds
        for name, count in figures["engines"].items():
            engines[name] += count
    files = sorted(f for f in wall_s if "/e2e/" in f or engines.get(f))
    if not files:
        return
    terminalreporter.section("e2e cost per file")
    for name in files:
        terminalreporter.write_line(f"{wall_s[name]:8.1f} s  {engines.get(name, 0):3d} engine(s)  {name}")
    total = sum(wall_s[f] for f in files)
    workers = len(config.stash[FROM_WORKERS])
    summed = f" (summed over {workers} workers)" if workers > 1 else ""
    terminalreporter.write_line(f"{total:8.1f} s  {sum(engines.values()):3d} engine(s)  in all{summed}")
