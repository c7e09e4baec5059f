"""Where engines run: the handle the rollout manager and the health monitor hold for each engine, and the launcher
that makes them.

An engine is a :class:`~.engine.VLLMEngine` server process owned by some process: a subprocess of the rollout
manager itself (:class:`LocalEngines`: tests, ``--debug-rollout-only`` without Ray, one node), or of a small Ray
actor on the node of the engine's placement-group bundle (``vime.ray.engine_actor``). Both give the same
:class:`EngineHandle`, so engine start, health and replacement are written once.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from vime.backends.vllm_utils.engine import VLLMEngine
from vime.utils.vllm_config import EngineSpec


class EngineHandle(Protocol):
    """One engine server, wherever its process runs (:class:`~.engine.VLLMEngine` is one)."""

    url: str  # where the router, the rollout and control calls reach it (its node's address)
    log_path: Path  # its log, on its node

    def start(self) -> EngineHandle: ...

    def wait_ready_sync(self, timeout: float | None = None) -> float: ...

    def is_alive(self) -> bool: ...

    def log_tail(self, n: int = 40) -> str: ...

    def stop(self, grace_s: float = 10.0) -> None: ...


class EngineLauncher(Protocol):
    """Makes (does not start) the engine of each slot; slot ``i`` always gets the same GPUs / bundle, also when
    the health monitor replaces a dead engine."""

    @property
    def on_gpu(self) -> bool:
        """Whether the engines run on GPUs (sleep mode, per-request seeds)."""
        ...

    @property
    def num_slots(self) -> int | None:
        """How many engines it can place (None: any number)."""
        ...

    def launch(
        self,
        args: argparse.Namespace,
        slot: int,
        log_path: Path,
        extra_args: Sequence[str],
        env: Mapping[str, str] | None = None,
        spec: EngineSpec | None = None,
    ) -> EngineHandle:
        """Slot ``slot``'s engine with vime's ``extra_args`` flags and ``env`` on top of its own environment;
        ``spec``: what it serves (default: the policy, ``--hf-checkpoint``)."""
        ...


@dataclass
class LocalEngines:
    """Engines as subprocesses of this process on loopback; ``gpus``: one ``CUDA_VISIBLE_DEVICES`` per slot
    (None: inherit this process's, e.g. on CPU). Without ``gpus``, the ``cpu_engines`` engines split this
    machine's cores (vLLM ignores the binding where the engine runs on CUDA)."""

    gpus: list[str] | None = None
    cpu_engines: int = 1

    @property
    def on_gpu(self) -> bool:
        return bool(self.gpus)

    @property
    def num_slots(self) -> int | None:
        return None if self.gpus is None else len(self.gpus)

    def launch(
        self,
        args: argparse.Namespace,
        slot: int,
        log_path: Path,
        extra_args: Sequence[str],
        env: Mapping[str, str] | None = None,
        spec: EngineSpec | None = None,
    ) -> VLLMEngine:
        gpus = {"CUDA_VISIBLE_DEVICES": self.gpus[slot]} if self.gpus else {}
        return VLLMEngine(
            args,
            log_path=log_path,
            extra_args=extra_args,
            env={**(env or {}), **gpus},
            spec=spec,
            cpu_share=None if self.gpus else (slot, self.cpu_engines),
        )
