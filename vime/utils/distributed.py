"""torch.distributed set-up and small collectives for the training backends.

The process-group backend is chosen here and only here: NCCL when CUDA is available, else gloo, so CPU and GPU
runs share one code path (STYLE.md).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vime.utils.misc import free_port
from vime.utils.net import listen_socket


def backend() -> str:
    """The torch.distributed backend for this machine: ``nccl`` with CUDA, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device() -> torch.device:
    """The device this rank computes on: its current CUDA device, or the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def init_distributed(
    timeout_minutes: int = 10, requested_backend: str | None = None, listener: socket.socket | None = None
) -> None:
    """Initialise the default process group from ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``.

    Does nothing when a group already exists. Without ``WORLD_SIZE`` in the environment this is a
    single-process group on a free loopback port, so a trainer also runs in a notebook or a unit test. With CUDA,
    the rank's device is ``LOCAL_RANK`` (default: rank modulo the visible GPUs). ``requested_backend``
    (``--distributed-backend``) must be the one this machine gets, or ``ValueError`` says why. Rank 0 hosts the
    group's store on ``listener`` when given (a socket bound to ``MASTER_ADDR`` only: torch's own store would
    listen on every interface); under torchrun the launcher's store is used.
    """
    if requested_backend is not None and requested_backend != backend():
        raise ValueError(
            f"--distributed-backend {requested_backend}: vime uses {backend()} here ({'CUDA' if backend() == 'nccl' else 'no CUDA'}"
            " visible); it picks nccl on GPUs and gloo on CPUs so that both run one code path. Drop the flag"
        )
    if dist.is_initialized():
        return
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size > 1 and not ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
        raise RuntimeError(
            f"WORLD_SIZE={world_size} but MASTER_ADDR/MASTER_PORT are not set; launch with torchrun or set them"
        )
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if listener is None and world_size == 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        listener = listen_socket(addr)
    port = str(listener.getsockname()[1]) if listener else os.environ.get("MASTER_PORT") or str(free_port())
    device_id = None
    if torch.cuda.is_available():
        device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        torch.cuda.set_device(device_id)
    timeout = timedelta(minutes=timeout_minutes)
    # rank 0 with a listener hosts the store on it; the other ranks (and torchrun's) connect to MASTER_ADDR. torch
    # prefixes the keys of an init_method's store with "default_pg" but not those of a store passed in: rank 0 adds
    # it, or the others never find its NCCL id (every multi-rank GPU trainer hung in its eager NCCL connect)
    where = (
        {"store": dist.PrefixStore("default_pg", tcp_store(addr, int(port), world_size, timeout, listener))}
        if listener is not None and rank == 0
        else {"init_method": f"tcp://{addr}:{port}"}
    )
    dist.init_process_group(
        backend(), rank=rank, world_size=world_size, timeout=timeout, device_id=device_id, **where
    )


def tcp_store(
    host: str, port: int, world_size: int, timeout: timedelta, listener: socket.socket | None = None
) -> dist.TCPStore:
    """A ``TCPStore`` server (rank 0's side) on ``host:port`` only, or on ``listener`` (already bound there): torch
    would bind every interface. It takes the socket over."""
    fd = (listener or listen_socket(host, port)).detach()
    return dist.TCPStore(
        host, port, world_size, True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd
    )


@dataclass(frozen=True)
class DataParallel:
    """A training rank's data-parallel group: the ranks that hold different samples. Its model-parallel peers
    (tensor, pipeline, context) hold the same samples and reduce over their own copy of this group; every reduction
    a trainer makes over its samples goes through here."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None  # None: every rank
    is_leader: bool = (
        True  # speaks for its samples (writes their debug data): one rank among its model-parallel peers
    )

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over the group (one collective, in float64 so counts stay exact)."""
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        """Element-wise maximum over the group (one collective, float64)."""
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order."""
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def _all_reduce(self, values: list[float], op: dist.ReduceOp) -> list[float]:
        if not values:  # every rank of the group has the same (empty) list: nothing to reduce
            return []
        tensor = torch.tensor(values, dtype=torch.float64, device=device())
        dist.all_reduce(tensor, op=op, group=self.group)
        return tensor.tolist()


def all_gather_1d(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Gather a 1-D tensor whose length may differ per rank of ``group`` (default: all); returns every rank's
    tensor, in rank order."""
    local = tensor.to(device())
    lengths = [
        torch.zeros(1, dtype=torch.int64, device=local.device) for _ in range(dist.get_world_size(group))
    ]
    dist.all_gather(
        lengths, torch.tensor([local.numel()], dtype=torch.int64, device=local.device), group=group
    )
    sizes = [int(n.item()) for n in lengths]
    # all_gather needs equal shapes: pad to the longest, then cut each back.
    padded = local.new_zeros(max(sizes))
    padded[: local.numel()] = local
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return [g[:n].to(tensor.device) for g, n in zip(gathered, sizes, strict=True)]
