"""Shared e2e fixtures: the tiny model (built once per session) and real vLLM OpenAI servers on CPU.

Servers run in their own session/process group (``start_new_session=True``) so ``stop()`` can end vLLM's
engine-core and worker processes with the API server; their logs go to files, shown when a start fails.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from vime.tools.make_tiny_model import build_tiny_model

# FACTS.md: on CPU always size the KV cache (the default reserves 92% of the NUMA node and can fail to start).
SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_SERVER_DEV_MODE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}
SERVER_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "256"]
SERVER_ARGS += ["--logprobs-mode", "processed_logprobs"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_processes(pgid: int) -> list:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    import psutil

    alive = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return alive


class VLLMServer:
    """A ``python -m vllm.entrypoints.openai.api_server`` process group on 127.0.0.1."""

    def __init__(self, model_dir: Path, log_path: Path, extra_args: list[str], env: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        self.cmd += ["--host", "127.0.0.1", "--port", str(self.port), *SERVER_ARGS, *extra_args]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            self.cmd,
            env={**os.environ, **SERVER_ENV, **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pgid = self.proc.pid  # leader of its new session and group
        self.ready_s: float | None = None  # seconds from launch to a healthy /health

    def live_processes(self) -> list:
        """Live members of the server's process group (API server, engine core, workers...)."""
        return group_processes(self.pgid)

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def wait_ready(self, timeout: float = 240.0) -> float:
        """Poll ``/health``; return seconds until ready. Fail with the log tail if the server dies or hangs."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"vLLM server exited with {self.proc.returncode}; log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except requests.RequestException:
                pass
            time.sleep(0.5)
        pytest.fail(f"vLLM server not ready after {timeout:.0f}s; log {self.log_path}:\n{self.log_tail()}")

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the whole group, SIGKILL it after ``grace`` seconds; returns once no member is alive."""
        if not self._signal_group(signal.SIGTERM, grace):
            self._signal_group(signal.SIGKILL, 10.0)
        self._log.close()

    def _signal_group(self, sig: signal.Signals, wait: float) -> bool:
        """Send ``sig`` to the group; True once no live member is left (within ``wait`` seconds)."""
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            self.proc.poll()  # reap the leader so it does not linger as a zombie
            if not self.live_processes():
                return True
            time.sleep(0.1)
        return False


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The default tiny model (seed 0, add3 data); shared, so tests must not write into it."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model") / "model", seed=0)


@pytest.fixture
def vllm_server_factory(tmp_path) -> Iterator[Callable[..., VLLMServer]]:
    """``start(model_dir, *extra_args, env=None, timeout=240) -> VLLMServer`` (ready); all stopped at teardown."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    servers: list[VLLMServer] = []

    def start(model_dir: Path, *extra_args: str, env: dict[str, str] | None = None, timeout: float = 240.0):
        server = VLLMServer(
            model_dir, tmp_path / f"vllm_server_{len(servers)}.log", list(extra_args), env or {}
        )
        servers.append(server)
        server.ready_s = server.wait_ready(timeout)
        return server

    yield start
    for server in servers:
        server.stop()
