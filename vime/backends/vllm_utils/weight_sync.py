"""Trainer -> vLLM engines weight sync (DESIGN.md §5): one protocol, three transports (``weight_transports.py``).

Per sync, on every training rank: let the transport stage what it can while engines still generate (``disk``
writes its files) -> ``pause(mode="keep")`` every engine -> the ``on_paused`` hook, if any
(``--custom-update-weight-paused-path``) -> move the weights (the transport) -> each engine worker records the
checksums of the parameters it now holds (``--check-weight-update-equal``; the weights check compares them later,
:mod:`vime.utils.weight_check`) -> label them with the version (``--flush-cache-interval``) -> ``reset_prefix_cache``
-> ``resume`` (always, also when the hook or the move failed; the error is then re-raised, with a note if resuming
failed too). Only rank 0 talks to the engines, directly, never through the router.

A paused request keeps its KV cache and finishes on the new weights (the prefix cache is dropped only where no
request holds it). A full refresh (:func:`vime.utils.inflight.is_full_refresh`) pauses with ``mode="abort"``
instead: in-flight requests end (finish reason ``abort``, the tokens so far) and the prefix cache must drop.

Bucket iteration is collective over the training ranks (each bucket's tensors are gathered over FSDP shards or
TP/PP/EP ranks), so EVERY training rank calls :func:`sync_weights` with its own bucket iterator, in step.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from functools import partial
from pathlib import Path

from vime.backends.vllm_utils.control_client import EngineGroup
from vime.backends.vllm_utils.weight_transports import (
    DiskTransport,
    DistributedTransport,
    TensorTransport,
    Transport,
    write_hf_safetensors,
)
from vime.utils.inflight import is_full_refresh, records_token_versions
from vime.utils.misc import load_function
from vime.utils.weight_buckets import Bucket

__all__ = ["sync_weights", "sync_weights_from_trainer", "make_transport", "write_hf_safetensors"]


def sync_weights(
    engine_urls: Sequence[str],
    buckets: Iterator[Bucket],
    transport: Transport,
    version: int,
    rank: int = 0,
    full_refresh: bool = False,
    label: bool = False,
    on_paused: Callable[[int, list[str]], None] | None = None,
    record_checksums: bool = False,
) -> dict[str, float]:
    """Push ``buckets`` to every engine at ``engine_urls`` as weight version ``version`` (see the module docstring);
    ``full_refresh``: abort the requests in flight and drop the prefix cache; ``label``: tell the engines the version;
    ``on_paused(version, engine_urls)`` runs on rank 0 once every engine is paused, before the weights move;
    ``record_checksums``: each engine worker records its parameters' checksums once loaded (``checksum_s``: how long).
    Rank 0 returns ``weight_sync/time_s`` (pause to resume, staging included), of it ``weight_sync/pause_s``,
    ``weight_sync/reset_s`` (labelling and the prefix-cache reset) and ``weight_sync/resume_s``, ``weight_sync/bytes``,
    ``weight_sync/gb_per_s``, ``weight_sync/version``, ``weight_sync/engines`` (how many it reached: fewer than
    the run's while a replacement starts) and ``weight_sync/full_refresh`` (1 or 0); the other ranks return ``{}``."""
    start, checksum_s = time.perf_counter(), None
    control = {"pause_s": 0.0, "reset_s": 0.0, "resume_s": 0.0}
    with EngineGroup(engine_urls) if rank == 0 else nullcontext() as engines:
        buckets, staged_bytes = transport.stage(buckets, rank, version)
        if engines is not None:
            engines.run(lambda engine: engine.pause(mode="abort" if full_refresh else "keep"))
            control["pause_s"] = time.perf_counter() - start
        try:
            if engines is not None and on_paused is not None:
                on_paused(version, list(engine_urls))
            moved_bytes = transport.move(buckets, engines, rank)
            if engines is not None:
                if record_checksums:
                    checksum_s = record_weights_checksums(engines, version)
                moved = time.perf_counter()
                if label:
                    engines.run(lambda engine: engine.set_weight_version(version))
                dropped = engines.run(lambda engine: engine.reset_prefix_cache())
                control["reset_s"] = time.perf_counter() - moved
                if full_refresh and not all(dropped):
                    kept = [url for url, ok in zip(engine_urls, dropped, strict=True) if not ok]
                    raise RuntimeError(
                        f"weight sync {version} is a full refresh (--flush-cache-interval) but the engines at {kept} "
                        "kept their prefix cache after aborting their requests"
                    )
        except BaseException as error:
            if engines is not None:  # resume anyway; if that fails too, the first error stays the one raised
                try:
                    engines.run(lambda engine: engine.resume())
                except Exception as resume_error:
                    error.add_note(f"resuming the engines afterwards failed too: {resume_error!r}")
            raise
        if engines is not None:
            resuming = time.perf_counter()
            engines.run(lambda engine: engine.resume())
            control["resume_s"] = time.perf_counter() - resuming
    if rank != 0:
        return {}
    elapsed = time.perf_counter() - start
    nbytes = staged_bytes + moved_bytes
    checksum = {} if checksum_s is None else {"weight_sync/checksum_s": checksum_s}
    return checksum | {
        "weight_sync/time_s": elapsed,
        **{f"weight_sync/{phase}": seconds for phase, seconds in control.items()},
        "weight_sync/bytes": float(nbytes),
        "weight_sync/gb_per_s": nbytes / elapsed / 1e9,
        "weight_sync/version": float(version),
        "weight_sync/engines": float(len(engine_urls)),
        "weight_sync/full_refresh": float(full_refresh),
    }


def record_weights_checksums(engines: EngineGroup, version: int) -> float:
    """Every worker of every engine records the checksums of the parameters it holds as weight version ``version``
    (``VimeWorkerExtension.record_weights_checksums``); how long it took. A worker that could not record them fails
    the sync, naming the engine."""
    started = time.perf_counter()
    answers = engines.run(lambda engine: engine.collective_rpc("record_weights_checksums", [version]))
    for url, workers in zip(engines.urls, answers, strict=True):
        for worker, answer in enumerate(workers or []):
            if "error" in answer:
                raise RuntimeError(
                    f"weight sync {version}: engine {url} worker {worker} could not record its weights' checksums: "
                    f"{answer['error']}"
                )
    return time.perf_counter() - started


# The transport of the current engine set, per transport name (the distributed one holds its weight group, so a new
# engine set, e.g. after an engine was replaced, closes the old one's).
_transports: dict[str, tuple[tuple, Transport]] = {}


def make_transport(
    args: argparse.Namespace, engine_urls: Sequence[str], disk_dir: str | Path | None, rank: int
) -> Transport:
    """The ``--update-weight-transport`` of this run, built once per engine set (see ``arg_validation``)."""
    name = args.update_weight_transport
    key = (tuple(engine_urls), str(disk_dir))
    if name in _transports and _transports[name][0] == key:
        return _transports[name][1]
    workers = args.rollout_num_gpus_per_engine
    if name == "disk":
        hook_path = args.custom_update_weight_post_write_path
        hook = load_function(hook_path, "--custom-update-weight-post-write-path") if hook_path else None
        transport = DiskTransport(
            disk_dir or args.update_weight_dir,
            keep_files=args.update_weight_disk_keep_files,
            post_write=(lambda version_dir: hook(args, version_dir, list(engine_urls))) if hook else None,
        )
    elif name == "distributed":
        transport = DistributedTransport(engine_urls, workers, rank)
    elif name == "tensor":
        transport = TensorTransport(len(engine_urls) * workers, workers)
    else:
        raise ValueError(f"--update-weight-transport {name!r}: expected disk, distributed (nccl) or tensor")
    if name in _transports:
        _transports.pop(name)[1].close()
    _transports[name] = (key, transport)
    return transport


def sync_weights_from_trainer(
    trainer,
    rank: int,
    args: argparse.Namespace,
    engine_urls: Sequence[str],
    version: int,
    disk_dir: str | None,
) -> dict[str, float]:
    """Blocking entry for a training rank (every rank calls it): the trainer's weights in buckets of
    ``--update-weight-buffer-size`` bytes over ``--update-weight-transport`` (MoE experts stacked where the transport
    moves them so), as a full refresh or in place per ``--flush-cache-interval``; rank 0 runs
    ``--custom-update-weight-paused-path`` while the engines are paused."""
    transport = make_transport(args, engine_urls, disk_dir, rank)
    buckets = trainer.iter_weight_buckets(
        args.update_weight_buffer_size, stack_experts=transport.stacks_experts
    )
    refresh = is_full_refresh(args.flush_cache_interval, version)
    hook_path = args.custom_update_weight_paused_path if rank == 0 else None
    on_paused = (
        partial(load_function(hook_path, "--custom-update-weight-paused-path"), args) if hook_path else None
    )
    return sync_weights(
        engine_urls, buckets, transport, version, rank, refresh, records_token_versions(args), on_paused,
        record_checksums=bool(args.check_weight_update_equal),
    )  # fmt: skip
