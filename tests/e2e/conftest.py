"""Shared e2e fixtures: the tiny model (built once per session), vime args for it, and real vLLM engines and
vllm-routers started with vime's own launcher (``vime.backends.vllm_utils``), stopped at teardown.

2 CPU cores: keep at most 2 engines alive at once (each takes ~25 s to start); reuse a module-scoped engine
where tests allow it.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from vime.backends.vllm_utils import fork_server
from vime.backends.vllm_utils.control_client import EngineGroup
from vime.backends.vllm_utils.engine import ServerProcess, VLLMEngine
from vime.backends.vllm_utils.external_engines import WORKER_EXTENSION_CLS
from vime.backends.vllm_utils.router import RouterProcess
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils.arguments import parse_args

# Test-friendly engine flags: no torch.compile warm-up, exact fp32 log-probs, a small context.
TEST_VLLM_FLAGS = ["--vllm-enforce-eager", "--vllm-dtype", "float32", "--vllm-max-model-len", "256"]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# One-process engines: vLLM's CPU platform runs the model in a separate worker process unless this is 0, which
# costs each engine start another interpreter and ~9 s here; with it, a one-GPU engine's layout (the worker inside
# the engine core, vLLM's "uni" executor) is what vLLM uses on GPUs too. Inherited by every engine a test starts;
# the fault-tolerance runs keep the CPU layout (they check each engine's worker is bound to its own cores).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MakeArgs = Callable[..., argparse.Namespace]
ENGINE_PACKAGES = ("vllm", "vllm_router", "ray")
INSTALL_STEP = "make install (scripts/install.sh: pip install -e '.[cpu,dev]'; on GPU machines '.[gpu,dev]')"


def require_engines() -> None:
    """Every e2e test needs vLLM, vllm-router and Ray: without one it is skipped with the reason, or fails under
    ``VIME_REQUIRE_ENGINES=1`` (``make test`` sets it, so a broken install cannot look green)."""
    missing = [name for name in ENGINE_PACKAGES if importlib.util.find_spec(name) is None]
    if not missing:
        return
    message = f"{', '.join(missing)} not installed; install with: {INSTALL_STEP}"
    if os.environ.get("VIME_REQUIRE_ENGINES") == "1":
        pytest.fail(f"VIME_REQUIRE_ENGINES=1 and {message}", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session", autouse=True)
def _engines_installed() -> None:
    require_engines()


@pytest.fixture(scope="session", autouse=True)
def _fork_server(_engines_installed) -> Iterator[None]:
    """One fork server per test process (xdist worker), set in the environment every run inherits: each CPU engine a
    test starts, through vime or the fixtures, is forked with vLLM's server already imported (about 5 CPU-s a start
    instead of 12: :mod:`vime.backends.vllm_utils.fork_server`). A test of which process owns an engine unsets it."""
    path = Path(tempfile.mkdtemp(prefix="vime-fork-")) / "fork.sock"
    server = fork_server.start_server(path, ["vllm.entrypoints.openai.api_server"])
    os.environ[fork_server.SOCKET_ENV] = str(path)
    yield
    del os.environ[fork_server.SOCKET_ENV]
    server.terminate()
    server.wait(timeout=30)
    shutil.rmtree(path.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The default tiny model (seed 0, add3 data); shared, so tests must not write into it."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model") / "model", seed=0)


@pytest.fixture(scope="session")
def make_args() -> MakeArgs:
    """``make_args(model_dir, *vime_flags)``: parsed vime args serving ``model_dir`` with the test flags."""

    def make(model_dir: str | Path, *flags: str) -> argparse.Namespace:
        return parse_args(
            [
                "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir),
                "--prompt-data", f"{model_dir}/train.jsonl", "--rollout-batch-size", "4",
                "--n-samples-per-prompt", "4", "--num-rollout", "1",
                *TEST_VLLM_FLAGS, *flags,
            ]
        )  # fmt: skip

    return make


class Launcher:
    """Starts engines and routers with logs under ``log_dir``; :meth:`stop_all` ends them all."""

    def __init__(self, log_dir: Path, make_args: MakeArgs):
        self.log_dir = log_dir
        self.make_args = make_args
        self.servers: list[ServerProcess] = []

    def engine(
        self,
        model_dir: str | Path,
        *vime_flags: str,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        timeout: float = 240.0,
    ) -> VLLMEngine:
        """A ready engine for ``model_dir``; ``vime_flags`` are vime/``--vllm-*`` flags, ``extra_args`` raw
        vLLM flags. Its ``ready_s`` is the start time in seconds."""
        require_engines()
        engine = VLLMEngine(
            self.make_args(model_dir, *vime_flags),
            log_path=self.log_dir / f"engine_{len(self.servers)}.log",
            extra_args=extra_args,
            env={**OFFLINE_ENV, **(env or {})},
        )
        self.servers.append(engine)
        engine.start()
        engine.ready_s = engine.wait_ready_sync(timeout)
        return engine

    def router(self, *vime_flags: str) -> RouterProcess:
        """A ready vllm-router (no workers); ``vime_flags`` may hold ``--router-*`` flags."""
        require_engines()
        router = RouterProcess(
            self.make_args("unused", *vime_flags), log_path=self.log_dir / f"router_{len(self.servers)}.log"
        )
        self.servers.append(router)
        router.start()
        router.wait_ready_sync(60)
        return router

    def stop_all(self) -> None:
        for server in reversed(self.servers):
            server.stop()


@pytest.fixture
def engine_factory(tmp_path, make_args) -> Iterator[Callable[..., VLLMEngine]]:
    """``engine_factory(model_dir, *vime_flags, extra_args=(), env=None, timeout=240) -> VLLMEngine`` (ready);
    all stopped at the end of the test."""
    launcher = Launcher(tmp_path, make_args)
    yield launcher.engine
    launcher.stop_all()


@pytest.fixture(scope="module")
def module_engine_factory(tmp_path_factory, make_args) -> Iterator[Callable[..., VLLMEngine]]:
    """Like ``engine_factory``, but the engines live until the end of the test module (share them)."""
    launcher = Launcher(tmp_path_factory.mktemp("engines"), make_args)
    yield launcher.engine
    launcher.stop_all()


@pytest.fixture
def router_factory(tmp_path, make_args) -> Iterator[Callable[..., RouterProcess]]:
    """``router_factory(*vime_flags) -> RouterProcess`` (ready, no workers); all stopped after the test."""
    launcher = Launcher(tmp_path, make_args)
    yield launcher.router
    launcher.stop_all()


@pytest.fixture(scope="module")
def module_router_factory(tmp_path_factory, make_args) -> Iterator[Callable[..., RouterProcess]]:
    """Like ``router_factory``, but the routers live until the end of the test module."""
    launcher = Launcher(tmp_path_factory.mktemp("routers"), make_args)
    yield launcher.router
    launcher.stop_all()


# --------------------------------------------------------------------------------------------------------------
# The pool: two real engines for the tiny model, started once per session, shared by every test that only needs
# serving (a train.py run attaches with --rollout-external-engine-addrs). Tests that kill, stop or sleep an engine
# start their own. Each user gets the engines reset: the checkpoint's weights reloaded (checked against the
# log-probs they gave when the pool started), the prefix cache dropped, generation resumed.

POOL_SIZE = 2
# The last pooled engine runs two API-server processes on its port (--vllm-api-server-count, through vLLM's serve),
# so every pooled test also proves that requests, pause/resume, weight syncs (collective_rpc), prefix-cache resets and
# /metrics work whichever front-end a connection lands on.
POOL_API_SERVERS = 2
# Room for slime's multi-turn and multi-agent examples (prompts of ~1,000 tokens): the engines serve the tiny model
# with 2,048 positions (its rotary table is computed, so positions under 512 score exactly as the checkpoint's).
POOL_CONTEXT = 2048
# A fixed sequence whose log-probs fingerprint the weights an engine holds.
PROBE_TOKENS = [1, 5, 9, 14, 3, 7, 11, 2, 8, 13]


class EnginePool:
    """The pool's engines (ready) and the tiny model they serve; :meth:`reset` gives them back their base state."""

    def __init__(self, model_dir: Path, engines: list[VLLMEngine]):
        self.model_dir = model_dir
        self.engines = engines
        self.base_log_probs = self._log_probs()

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.engines]

    def addrs(self, count: int = POOL_SIZE) -> list[str]:
        """``--rollout-external-engine-addrs`` values for the first ``count`` engines."""
        return [url.removeprefix("http://") for url in self.urls[:count]]

    def _log_probs(self) -> list[list[float]]:
        with EngineGroup(self.urls) as group:
            return group.run(lambda engine: engine.prompt_log_probs(str(self.model_dir), PROBE_TOKENS))

    def reset(self) -> None:
        """Resume, drop any weight group, reload the checkpoint's weights and the prefix cache; then check every
        engine scores the probe exactly as when the pool started."""

        async def reset_one(engine):
            await engine.resume()
            await engine.collective_rpc("destroy_weight_update_group")
            await engine.reload_weights(str(self.model_dir))
            assert await engine.reset_prefix_cache()

        for engine in self.engines:
            assert engine.is_alive(), f"a pooled engine died (a test must not kill one): {engine.log_tail()}"
        with EngineGroup(self.urls) as group:
            group.run(reset_one)
        assert self._log_probs() == self.base_log_probs, "a pooled engine did not get its base weights back"


def without_vllm_flags(argv: list[str]) -> list[str]:
    """``argv`` less its ``--vllm-*`` flags and their values (they configure engines a run starts itself)."""
    kept, skipping = [], False
    for token in argv:
        if token.startswith("--"):
            skipping = token.startswith("--vllm-")
        if not skipping:
            kept.append(token)
    return kept


@pytest.fixture(scope="session")
def shared_engines(tiny_model_dir, tmp_path_factory, make_args) -> Iterator[EnginePool]:
    require_engines()
    log_dir = tmp_path_factory.mktemp("pool")
    flags = (
        "--vllm-max-model-len", str(POOL_CONTEXT),
        "--vllm-hf-overrides", json.dumps({"max_position_embeddings": POOL_CONTEXT}),
    )  # fmt: skip
    front_ends = ("--vllm-api-server-count", str(POOL_API_SERVERS))
    engines = [
        VLLMEngine(
            make_args(tiny_model_dir, *flags, *(front_ends if i == POOL_SIZE - 1 else ())),
            log_path=log_dir / f"engine_{i}.log",
            # --enable-scale-out: vLLM's generate route, for runs with --flush-cache-interval
            extra_args=("--worker-extension-cls", WORKER_EXTENSION_CLS, "--enable-scale-out"),
            env=OFFLINE_ENV,
            cpu_share=(i, POOL_SIZE),
        )
        for i in range(POOL_SIZE)
    ]
    try:
        for engine in engines:
            engine.start()
        for engine in engines:  # they start together
            engine.wait_ready_sync(300)
        yield EnginePool(tiny_model_dir, engines)
    finally:
        for engine in engines:
            engine.stop()


@pytest.fixture
def engine_pool(shared_engines) -> EnginePool:
    """The session's pooled engines, reset for this test."""
    shared_engines.reset()
    return shared_engines


# --------------------------------------------------------------------------------------------------------------
# Whole runs of train.py / train_async.py as subprocesses, and the processes they leave behind.

RUN_MARKER_ENV = "VIME_TEST_RUN_MARKER"  # inherited by Ray, the engines and the router a run starts


def new_marker(name: str) -> str:
    """A run marker no other test session uses (several may run these tests on one machine at once)."""
    return f"{name}-{os.getpid()}-{time.time_ns()}"


def run_env(marker: str, **extra: str) -> dict[str, str]:
    """The environment of a test run: offline, tagged with ``marker`` so its processes can be found."""
    return {**os.environ, **OFFLINE_ENV, RUN_MARKER_ENV: marker, **extra}


def start_run(
    argv: list[str], out_dir: Path, marker: str, cwd: Path | None = None, **env: str
) -> subprocess.Popen:
    """``argv`` (a whole ``train.py`` / ``train_async.py`` run) started in the background, tagged with ``marker``; its
    output in ``out_dir``/stdout.txt and stderr.txt (files: two runs' pipes read one after the other could fill and
    block one)."""
    with open(out_dir / "stdout.txt", "w") as stdout, open(out_dir / "stderr.txt", "w") as stderr:
        return subprocess.Popen(
            argv, stdout=stdout, stderr=stderr, text=True, cwd=cwd or out_dir, env=run_env(marker, **env)
        )


def run_side_by_side(runs: dict[str, Callable[[], tuple[Path, subprocess.Popen]]], timeout: float) -> None:
    """Start every run (``name -> start()``, returning its output dir and process) at once, and wait for all: each
    spends much of its time waiting on itself (start-up, then generate, train and sync in turn), so two share the
    2 cores well. Asserts each exited 0, with its stderr's tail; kills what is left on a failure or a timeout."""
    started: dict[str, tuple[Path, subprocess.Popen]] = {}
    try:
        for name, start in runs.items():
            started[name] = start()
        deadline = time.monotonic() + timeout
        for name, (out_dir, proc) in started.items():
            returncode = proc.wait(timeout=max(deadline - time.monotonic(), 1))
            assert returncode == 0, f"{name}: {(out_dir / 'stderr.txt').read_text()[-3000:]}"
    finally:
        for _, proc in started.values():
            proc.kill()  # a no-op on those that ended


def marked_processes(marker: str) -> list[str]:
    """``"pid name cmdline"`` of every live process whose environment carries ``marker``."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        try:
            if (
                proc.info["status"] != psutil.STATUS_ZOMBIE
                and fork_server.environ_of(proc).get(RUN_MARKER_ENV) == marker
            ):
                found.append(f"{proc.pid} {proc.info['name']} {' '.join(proc.info['cmdline'] or [])[:120]}")
        except psutil.Error:
            pass
    return found


def wait_until_no_marked_processes(marker: str, timeout: float = 30.0) -> list[str]:
    """Poll until no process carries ``marker``; returns the leftovers (empty on success)."""
    deadline = time.monotonic() + timeout
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def non_loopback_listeners(marker: str) -> list[str]:
    """``"address:port pid name"`` of every TCP socket listening on other than loopback (all interfaces included)
    in a process whose environment carries ``marker``."""
    pids = {}
    for proc in psutil.process_iter(["name"]):
        try:
            if fork_server.environ_of(proc).get(RUN_MARKER_ENV) == marker:
                pids[proc.pid] = proc.info["name"]
        except psutil.Error:
            pass
    found = []
    for conn in psutil.net_connections("tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid not in pids:
            continue
        address = ipaddress.ip_address(conn.laddr.ip.split("%")[0])
        if not (getattr(address, "ipv4_mapped", None) or address).is_loopback:
            found.append(f"{conn.laddr.ip}:{conn.laddr.port} {conn.pid} {pids[conn.pid]}")
    return found


def read_metrics(log_dir: Path) -> list[dict]:
    """The records of ``log_dir/metrics.jsonl``."""
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def release_sync_when_replacement_is_up(
    log_dir: Path, hold_dir: Path, version: int, done: threading.Event
) -> None:
    """Hold weight sync ``version`` (``hold_dir/hold_<version>``, for a run with ``sync_hold``'s hook) until a replaced
    engine's server is up, so the sync after it reaches the replacement and the last rollout runs on it too (a run of
    a few seconds per rollout would otherwise end before a 20 s start)."""
    while not done.is_set():
        if any(
            "Application startup complete" in p.read_text(errors="replace")
            for p in log_dir.glob("engine_*.restart1.log")
        ):
            break
        time.sleep(0.2)
    (hold_dir / f"hold_{version}").unlink(missing_ok=True)
