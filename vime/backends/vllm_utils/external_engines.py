"""Engines vime did not start (``--rollout-external-engine-addrs``, as in slime): vime attaches to running vLLM
servers, puts them behind its router, pushes its weights into them, and leaves them running at exit.

An attached engine must be what vime would have started (``vime.backends.vllm_utils.engine``): dev-mode control
routes, vime's worker extension (the ``distributed``/``tensor`` transports land there), ``--logprobs-mode
processed_logprobs`` (the log-probs the PPO ratio compares against), vime's control-secret middleware with this
run's secret (``VIME_CONTROL_SECRET`` in both environments), and as many workers as
``--rollout-num-gpus-per-engine`` (the weight group's ranks). :func:`describe_engine` reads all of that from the
engine's ``/server_info`` and one authenticated control call, and names whatever is missing.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vime.backends.vllm_utils import control_auth
from vime.backends.vllm_utils.generate_api import ENGINE_FLAG, GENERATE_PATH
from vime.utils.inflight import records_token_versions
from vime.utils.vllm_config import EngineSpec, external_engine_url

WORKER_EXTENSION_CLS = "vime.backends.vllm_utils.worker_extension.VimeWorkerExtension"
# How an engine for vime is started by hand (README), besides VLLM_SERVER_DEV_MODE=1 and VIME_CONTROL_SECRET.
REQUIRED_FLAGS = (
    f"--worker-extension-cls {WORKER_EXTENSION_CLS} --logprobs-mode processed_logprobs "
    f"--middleware {control_auth.MIDDLEWARE}"
)
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an HTTP proxy


class ExternalEngineError(RuntimeError):
    """An external engine cannot serve this run: the message names the engine, what is missing and the fix."""


@dataclass(frozen=True)
class EngineInfo:
    """What :func:`describe_engine` learned of one engine."""

    url: str
    model: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    on_gpu: bool
    dtype: str  # the weights' dtype as vLLM names it without "torch.": "float32", "bfloat16", ...

    @property
    def num_workers(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def _get(
    url: str, headers: Mapping[str, str] | None = None, timeout: float = 30.0, post: bool = False
) -> tuple[int, str]:
    """``GET url`` (``post``: ``POST`` an empty JSON body): (status, body); status 0 when nothing answered (the body
    says why)."""
    data = b"{}" if post else None
    request = urllib.request.Request(
        url, data=data, headers={**({"Content-Type": "application/json"} if post else {}), **(headers or {})}
    )
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, repr(exc)


def _dtype_name(dtype: object) -> str:
    """``/server_info``'s model dtype (``"torch.float32"``) as a plain name (``"float32"``)."""
    return str(dtype).removeprefix("torch.")


def served_dtype(url: str, timeout: float = 30.0) -> str:
    """The dtype of the weights the engine at ``url`` serves (``"float32"``, ``"bfloat16"``, ...), from its
    ``/server_info``; ``RuntimeError`` when it does not answer."""
    status, body = _get(f"{url}/server_info?config_format=json", timeout=timeout)
    if status != 200:
        raise ExternalEngineError(f"the engine at {url}: GET /server_info failed ({status or body})")
    return _dtype_name(json.loads(body)["vllm_config"]["model_config"].get("dtype"))


def describe_engine(
    url: str, model_name: str, num_gpus_per_engine: int, timeout: float = 30.0, generate_route: bool = False
) -> EngineInfo:
    """Check that the engine at ``url`` can serve a vime run that asks for model ``model_name`` (its
    ``--hf-checkpoint``) with engines of ``num_gpus_per_engine`` workers (``generate_route``: and answers vLLM's
    generate route, for ``--flush-cache-interval``), and return what it runs; :class:`ExternalEngineError` listing
    every requirement it misses."""
    where = f"--rollout-external-engine-addrs: the engine at {url}"
    status, body = _get(f"{url}/health", timeout=timeout)
    if status != 200:
        raise ExternalEngineError(f"{where} does not answer GET /health ({status or body}); is it running?")
    status, body = _get(f"{url}/server_info?config_format=json", timeout=timeout)
    if status == 404:
        raise ExternalEngineError(
            f"{where} has no dev-mode routes (GET /server_info: 404): start it with VLLM_SERVER_DEV_MODE=1"
        )
    if status != 200:
        raise ExternalEngineError(f"{where}: GET /server_info failed ({status}): {body[:300]}")
    config = json.loads(body)["vllm_config"]
    model, parallel = config["model_config"], config["parallel_config"]
    missing = []
    served = model.get("served_model_name") or model.get("model")
    if model_name not in (served, model.get("model")):
        missing.append(
            f"the model {model_name} that requests name (it serves {served}: start it with --model {model_name}, or "
            f"--served-model-name {model_name})"
        )
    if parallel.get("worker_extension_cls") != WORKER_EXTENSION_CLS:
        missing.append(
            f"vime's worker extension (--worker-extension-cls {WORKER_EXTENSION_CLS}; it runs "
            f"{parallel.get('worker_extension_cls') or 'none'})"
        )
    if model.get("logprobs_mode") != "processed_logprobs":
        missing.append(
            f"--logprobs-mode processed_logprobs (it returns {model.get('logprobs_mode')}: not the log-probs after "
            "temperature that the trainer compares against)"
        )
    info = EngineInfo(
        url=url,
        model=str(served),
        tensor_parallel_size=int(parallel["tensor_parallel_size"]),
        pipeline_parallel_size=int(parallel["pipeline_parallel_size"]),
        on_gpu=str((config.get("device_config") or {}).get("device")) != "cpu",
        dtype=_dtype_name(model.get("dtype")),
    )
    if info.num_workers != num_gpus_per_engine:
        missing.append(
            f"{num_gpus_per_engine} worker(s) as --rollout-num-gpus-per-engine says (it runs tensor-parallel "
            f"{info.tensor_parallel_size} x pipeline-parallel {info.pipeline_parallel_size}: pass "
            f"--rollout-num-gpus-per-engine {info.num_workers})"
        )
    if generate_route and _get(f"{url}{GENERATE_PATH}", timeout=timeout, post=True)[0] in (0, 403, 404):
        missing.append(
            f"vLLM's generate route (POST {GENERATE_PATH}), through which --flush-cache-interval reads the weight "
            f"version of each token: start it with {ENGINE_FLAG}"
        )
    status, _ = _get(f"{url}/is_paused", timeout=timeout)
    if status != 403:
        missing.append(
            f"vime's control secret on its control routes (GET /is_paused without it answered {status or 'nothing'}, "
            f"not 403: start it with --middleware {control_auth.MIDDLEWARE})"
        )
    else:
        secret = {control_auth.HEADER: control_auth.run_secret()}
        status, body = _get(f"{url}/is_paused", headers=secret, timeout=timeout)
        if status != 200:
            missing.append(
                f"this run's control secret (GET /is_paused with it: {status or body}; give the engines and this run "
                f"the same {control_auth.SECRET_ENV})"
            )
    if missing:
        raise ExternalEngineError(
            f"{where} cannot serve this run; it lacks: " + "; ".join(missing) + f". vime's engines run with "
            f"VLLM_SERVER_DEV_MODE=1, {control_auth.SECRET_ENV} and {REQUIRED_FLAGS}"
        )
    return info


class ExternalEngine:
    """An :class:`~.engine_fleet.EngineHandle` on a running engine vime does not own: starting it is a no-op,
    stopping it leaves it running."""

    def __init__(self, info: EngineInfo):
        self.info = info
        self.url = info.url
        self.log_path = Path(f"(the log of the external engine at {info.url})")

    def start(self) -> ExternalEngine:
        return self

    def wait_ready_sync(self, timeout: float | None = None) -> float:
        """Wait until ``GET /health`` answers 200 (at most ``timeout`` seconds); the seconds waited."""
        started = time.monotonic()
        while _get(f"{self.url}/health", timeout=5.0)[0] != 200:
            if timeout is not None and time.monotonic() - started > timeout:
                raise ExternalEngineError(
                    f"the external engine at {self.url} did not answer /health in {timeout:.0f} s"
                )
            time.sleep(0.5)
        return time.monotonic() - started

    def is_alive(self) -> bool:
        return _get(f"{self.url}/health", timeout=5.0)[0] == 200

    def log_tail(self, n: int = 40) -> str:
        return f"(vime did not start the engine at {self.url}: its log is wherever it was started)"

    def stop(self, grace_s: float = 10.0) -> None:
        """Leave it running: its owner stops it."""


@dataclass
class ExternalEngines:
    """The :class:`~.engine_fleet.EngineLauncher` of ``--rollout-external-engine-addrs``: slot ``i`` is the engine
    at ``urls[i]``, checked (:func:`describe_engine`) on first use."""

    urls: list[str]
    model_name: str
    num_gpus_per_engine: int
    generate_route: bool = False  # --flush-cache-interval

    @functools.cached_property
    def infos(self) -> list[EngineInfo]:
        return [
            describe_engine(
                url, self.model_name, self.num_gpus_per_engine, generate_route=self.generate_route
            )
            for url in self.urls
        ]

    @property
    def on_gpu(self) -> bool:
        return any(info.on_gpu for info in self.infos)

    @property
    def num_slots(self) -> int | None:
        return len(self.urls)

    def launch(
        self,
        args: argparse.Namespace,
        slot: int,
        log_path: Path,
        extra_args: Sequence[str],
        env: Mapping[str, str] | None = None,
        spec: EngineSpec | None = None,
    ) -> ExternalEngine:
        return ExternalEngine(self.infos[slot])


def external_engines(args: argparse.Namespace) -> ExternalEngines:
    """The launcher for ``args.rollout_external_engine_addrs``."""
    urls = [external_engine_url(addr) for addr in args.rollout_external_engine_addrs]
    return ExternalEngines(
        urls, args.hf_checkpoint, args.rollout_num_gpus_per_engine, records_token_versions(args)
    )
