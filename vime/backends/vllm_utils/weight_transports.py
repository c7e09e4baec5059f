"""How weights move from the training ranks into the engines; ``weight_sync.sync_weights`` runs the protocol around
them (DESIGN.md §5). Each transport has two steps: ``stage`` (before the engines pause; returns the buckets still to
move and the bytes already staged) and ``move`` (engines paused; returns the bytes moved). ``engines`` is rank 0's
:class:`~.control_client.EngineGroup`; other ranks get None and only take part in the collectives.

- ``disk``: rank 0 writes HF safetensors into ``<dir>/v<version>``, which the engines can read, while they still
  generate (then ``--custom-update-weight-post-write-path`` runs); every engine ``reload_weights`` from it, and
  the directory is deleted unless ``--update-weight-disk-keep-files``.
- ``distributed``: rank 0 broadcasts each bucket, flattened into one byte buffer behind a small header (its layout),
  over a weight process group spanning it and every engine worker (NCCL on GPU, gloo on CPU); each worker takes the
  whole sync in one ``receive_weights_stream`` call, loading bucket k while bucket k+1 arrives
  (``worker_extension.VimeWorkerExtension``).
- ``tensor`` (colocated GPU runs): the training rank on each engine worker's GPU flattens each bucket into a
  staging buffer shared once per sync through CUDA IPC; the worker loads straight from it.

``distributed`` and ``tensor`` pipeline two buckets: the next bucket is gathered and flattened (into the other of
two staging buffers) while the engines load the previous one. Each flattened tensor carries its checksum; an engine
worker that finds one changed loads nothing of that bucket and the sync fails with :class:`BucketRejected`, naming
the engine and the tensor (the engine keeps running). They move MoE experts stacked, one tensor per layer
and projection (``vime.utils.stacked_experts``; ``stacks_experts``); ``disk`` writes HF per-expert tensors. After a
move, rank 0's ``phases`` says where its seconds went (:class:`MovePhases`; ``bench/weight_sync.py`` reports it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import secrets
import shutil
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from vime.backends.vllm_utils.control_client import EngineGroup
from vime.backends.vllm_utils.cuda_ipc import share_cuda_buffer
from vime.backends.vllm_utils.worker_extension import (
    SYNC_TOKEN_FILE,
    WeightGroup,
    create_weight_group,
    poll_works,
)
from vime.utils.net import listen_socket
from vime.utils.weight_buckets import Bucket, add_checksums, flatten_bucket, with_last_flag


class Transport(Protocol):
    stacks_experts: bool  # whether the buckets it moves may hold stacked experts (vime.utils.stacked_experts)
    phases: MovePhases  # rank 0's seconds by phase in the last sync

    def stage(self, buckets: Iterator[Bucket], rank: int, version: int) -> tuple[Iterator[Bucket], int]: ...

    def move(self, buckets: Iterator[Bucket], engines: EngineGroup | None, rank: int) -> int: ...

    def close(self) -> None:
        """Release what it holds across syncs (when the engine set changes)."""


class MovePhases(Counter):
    """Seconds of one ``move`` by phase. On the sending rank: ``move_s`` (all of it), ``gather_s`` (producing the
    next bucket: the gathers over training ranks), ``pack_s`` (flattening it into a staging buffer, and its checksums),
    ``engine_wait_s`` (waiting for the engines' answers: to the previous bucket with ``tensor``, at the end of the
    sync with ``distributed``) and ``send_wait_s`` (waiting for a staging buffer's broadcast to leave it). From the
    engine workers' own answers, summed over the answers (the slowest worker of each; ``distributed`` answers once
    per sync, ``tensor`` once per bucket): ``engine_receive_s`` (``distributed``: the time the workers waited for
    data, headers included) and ``engine_load_s``."""

    def timed(self, phase: str, items: Iterable) -> Iterator:
        """``items``, adding the time each ``next()`` takes to ``phase``."""
        iterator = iter(items)
        while True:
            started = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                return
            finally:
                self[phase] += time.perf_counter() - started
            yield item

    @contextlib.contextmanager
    def span(self, phase: str) -> Iterator[None]:
        """Add the block's seconds to ``phase``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self[phase] += time.perf_counter() - started

    def wait(self, phase: str, future: concurrent.futures.Future, urls: Sequence[str]) -> list:
        """``future.result()`` (the answers of the engines at ``urls`` to one bucket), adding the wait to ``phase``
        and the slowest worker's reported ``receive_s``/``load_s`` to ``engine_receive_s``/``engine_load_s``.
        Raises :class:`BucketRejected` if a worker rejected the bucket, ``RuntimeError`` if one left the sync."""
        started = time.perf_counter()
        try:
            answers = future.result()
        finally:
            self[phase] += time.perf_counter() - started
        for url, engine in zip(urls, answers or [], strict=False):
            for worker, report in enumerate(engine or []):
                if isinstance(report, dict) and report.get("rejected"):
                    raise BucketRejected(
                        f"engine {url} (worker {worker}) rejected a bucket: {report['rejected']}"
                    )
                if isinstance(report, dict) and report.get("aborted"):
                    raise RuntimeError(f"engine {url} (worker {worker}) left the sync: {report['aborted']}")
        reports = [r for engine in answers or [] for r in engine or [] if isinstance(r, dict)]
        for key in ("receive_s", "load_s"):
            if values := [r[key] for r in reports if key in r]:
                self[f"engine_{key}"] += max(values)
        return answers


class BucketRejected(RuntimeError):
    """An engine worker found a tensor of a bucket changed on the way (its checksum); the engine keeps running with
    the weights it had loaded so far, and the sync fails."""


def _drain(buckets: Iterable[Bucket]) -> int:
    """Iterate the buckets (a rank that sends nothing still takes part in their gathers); their bytes."""
    return sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)


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


class DiskTransport:
    """``disk``: safetensors files in ``directory/v<version>`` (shared with the engines), then ``reload_weights``;
    ``post_write(version_dir)`` runs on rank 0 between the two; the version's files are deleted once loaded unless
    ``keep_files``. Each sync also writes a fresh token there, and every engine must read it back before reloading:
    an engine on a node where the directory is not shared (or is another directory of the same name) would load
    nothing or stale weights."""

    stacks_experts = False  # vLLM reads the files as an HF checkpoint

    def __init__(
        self,
        directory: str | Path | None,
        keep_files: bool = False,
        post_write: Callable[[str], None] | None = None,
    ):
        if directory is None:
            raise ValueError(
                "the disk weight-sync transport needs a shared directory: pass --update-weight-dir"
            )
        self.directory = Path(directory)
        self.keep_files = keep_files
        self.post_write = post_write
        self.version_dir: Path | None = None
        self.token = ""
        self.phases = MovePhases()

    def stage(self, buckets: Iterator[Bucket], rank: int, version: int) -> tuple[Iterator[Bucket], int]:
        if rank != 0:
            _drain(buckets)
            return iter(()), 0
        self.phases = MovePhases()
        self.version_dir = self.directory / f"v{version:07d}"
        with self.phases.span("write_s"):
            nbytes = write_hf_safetensors(buckets, self.version_dir)
        if self.post_write is not None:  # it sees the weights only
            self.post_write(str(self.version_dir))
        self.token = secrets.token_hex(8)
        (self.version_dir / SYNC_TOKEN_FILE).write_text(self.token)
        return iter(()), nbytes

    def move(self, buckets: Iterator[Bucket], engines: EngineGroup | None, rank: int) -> int:
        if engines is not None:
            with self.phases.span("move_s"):
                self._reload(engines)
        return 0

    def _reload(self, engines: EngineGroup) -> None:
        """Every engine reads the token back, then reloads the version's files (deleted afterwards unless kept)."""
        path = str(self.version_dir / SYNC_TOKEN_FILE)
        seen = engines.run(lambda engine: engine.collective_rpc("read_sync_token", kwargs={"path": path}))
        for url, tokens in zip(engines.urls, seen, strict=True):
            if any(token != self.token for token in tokens or [None]):
                raise RuntimeError(
                    f"--update-weight-transport disk: the engine at {url} does not see the weights the trainer "
                    f"wrote to {self.version_dir} on {socket.gethostname()} (it reads {tokens} from "
                    f"{SYNC_TOKEN_FILE}, not {self.token!r}): the directory (--update-weight-dir) must be on a "
                    "filesystem shared by the trainer's node and every engine's node, or use "
                    "--update-weight-transport distributed"
                )
        kwargs = {"weights_path": str(self.version_dir)}
        engines.run(lambda engine: engine.collective_rpc("reload_weights_from_path", kwargs=kwargs))
        if not self.keep_files:
            shutil.rmtree(self.version_dir)

    def close(self) -> None:
        pass


def _address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (what engine workers there can reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP connect sends nothing; it only picks the route
        return probe.getsockname()[0]


class DistributedTransport:
    """``distributed``: rank 0's end of one weight group with every worker of every engine (engine ``i``'s workers
    are ranks ``1 + i * workers_per_engine + worker rank``), built at the first sync and reused. If a move fails
    (e.g. an engine died) the group may be left mid-collective: it is closed, which tells the workers of the live
    engines to leave the sync (``WeightGroup.close``; they drop what they staged of it and answer ``aborted``), and
    the next sync builds a new one."""

    stacks_experts = True

    def __init__(
        self,
        engine_urls: Sequence[str],
        workers_per_engine: int,
        rank: int,
        backend: str | None = None,
        timeout_s: float = 600.0,
    ):
        self.engine_urls = list(engine_urls)
        self.workers_per_engine = workers_per_engine
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout_s = timeout_s
        self.world_size = 1 + len(self.engine_urls) * workers_per_engine
        self.group: WeightGroup | None = None
        self.phases = MovePhases()

    def stage(self, buckets: Iterator[Bucket], rank: int, version: int) -> tuple[Iterator[Bucket], int]:
        return buckets, 0

    def connect(self, engines: EngineGroup) -> None:
        """Build the group: rank 0 joins (in a thread: it blocks until every rank joins) while every engine's
        workers join through ``init_weight_update_group``."""
        address = _address_towards(urlparse(self.engine_urls[0]).hostname or "127.0.0.1")
        listener = listen_socket(address)  # the store listens on that address only
        port = listener.getsockname()[1]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            join = pool.submit(
                create_weight_group, address, port, 0, self.world_size, self.backend, self.timeout_s, listener
            )
            engines.run(
                [
                    lambda engine, offset=offset: engine.collective_rpc(
                        "init_weight_update_group",
                        kwargs=dict(
                            master_address=address,
                            master_port=port,
                            rank_offset=offset,
                            world_size=self.world_size,
                            backend=self.backend,
                            timeout_s=self.timeout_s,
                        ),  # fmt: skip
                    )
                    for offset in range(1, self.world_size, self.workers_per_engine)
                ]
            )
            self.group = join.result()

    def move(self, buckets: Iterator[Bucket], engines: EngineGroup | None, rank: int) -> int:
        """One ``receive_weights_stream`` call per engine for the whole sync; per bucket a header and the flattened
        bucket are broadcast (asynchronous), the next bucket gathered and packed meanwhile into the other staging
        buffer, and the engines' answers read at the end. While waiting for a broadcast to leave a buffer the
        engines' answers are watched, so an engine that failed mid-sync fails the move at once; the other engines
        then leave their call too (:meth:`close`)."""
        if engines is None:
            return _drain(buckets)
        if self.group is None:
            self.connect(engines)
        phases = self.phases = MovePhases()
        started = time.perf_counter()
        staging = _PingPong(self.group.device)
        sent: list[list[dist.Work]] = [[], []]
        nbytes = 0
        loading = engines.submit(lambda engine: engine.collective_rpc("receive_weights_stream"))
        try:
            stream = with_last_flag(phases.timed("gather_s", buckets))
            for k, (bucket, final) in enumerate(_at_least_one(stream)):
                with phases.span("send_wait_s"):
                    _wait_sent(sent[k % 2], loading)  # the broadcast of bucket k-2 has left this buffer
                with phases.span("pack_s"):
                    buffer, layout, _ = staging.fill(k, bucket)
                header = {"layout": layout, "nbytes": buffer.numel(), "final": final}
                sent[k % 2] = [*self.group.send_header(header), self.group.broadcast(buffer)]
                nbytes += buffer.numel()
            with phases.span("send_wait_s"):
                for works in sent:
                    _wait_sent(works, loading)
            phases.wait("engine_wait_s", loading, engines.urls)
        except BaseException as error:
            # possibly mid-collective: the engines leave the sync, and the next one builds a new group
            self.close(f"the trainer's move failed: {error!r}")
            raise
        phases["move_s"] = time.perf_counter() - started
        return nbytes

    def close(self, reason: str = "the engine set changed") -> None:
        if self.group is not None:
            group, self.group = self.group, None
            group.close(reason)


class TensorTransport:
    """``tensor``: CUDA IPC between each training rank and the engine worker on its GPU (engine ``i``'s worker
    ``w`` shares a GPU with training rank ``i * workers_per_engine + w``). Per bucket every sharing rank flattens
    it into a staging buffer, rank 0 gathers the buffers' handles and layouts and has every worker load its own,
    and every rank learns whether that worked (so an engine error fails all ranks on the same bucket)."""

    stacks_experts = True

    def __init__(self, num_workers: int, workers_per_engine: int):
        self.num_workers = num_workers
        self.workers_per_engine = workers_per_engine
        self.phases = MovePhases()

    def stage(self, buckets: Iterator[Bucket], rank: int, version: int) -> tuple[Iterator[Bucket], int]:
        return buckets, 0

    def move(self, buckets: Iterator[Bucket], engines: EngineGroup | None, rank: int) -> int:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "--update-weight-transport tensor (CUDA IPC) needs GPUs; use distributed or disk"
            )
        world_size = dist.get_world_size()
        if self.num_workers > world_size:
            raise ValueError(
                f"{self.num_workers} colocated engine workers but {world_size} training ranks: with the tensor "
                "transport every engine GPU must hold a training rank (--rollout-num-gpus <= the actor's GPUs)"
            )
        phases = self.phases = MovePhases()
        started = time.perf_counter()
        staging = _PingPong(torch.device("cuda", torch.cuda.current_device()))
        handles: list[dict | None] = [None, None]
        loading: concurrent.futures.Future | None = None
        nbytes = 0
        try:
            for k, (bucket, final) in enumerate(with_last_flag(phases.timed("gather_s", buckets))):
                # buffer k % 2 is free: bucket k-2's load ended before any rank passed the last status gather
                shared = None
                if rank < self.num_workers:
                    with phases.span("pack_s"):
                        buffer, layout, new = staging.fill(k, bucket)
                        if new:  # shared once; the engine worker keeps it mapped for the rest of the sync
                            handles[k % 2] = share_cuda_buffer(buffer)
                        torch.cuda.current_stream().synchronize()  # written before another process reads it
                    shared = {"handle": handles[k % 2], "layout": layout}
                everyone: list = [None] * world_size
                dist.all_gather_object(everyone, shared)
                error = None
                if engines is not None:
                    error = _wait(loading, phases, engines.urls)
                    if error is None:
                        per_engine = [
                            {"buffers": everyone[i : i + self.workers_per_engine], "final": final}
                            for i in range(0, self.num_workers, self.workers_per_engine)
                        ]
                        loading = engines.submit(
                            [
                                lambda engine, kwargs=kwargs: engine.collective_rpc(
                                    "update_weights_from_ipc", kwargs=kwargs
                                )
                                for kwargs in per_engine
                            ]
                        )
                _agree_on(error)
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            _agree_on(_wait(loading, phases, engines.urls) if engines is not None else None)
        finally:
            staging = handles = None
            torch.cuda.ipc_collect()
        phases["move_s"] = time.perf_counter() - started
        return nbytes

    def close(self) -> None:
        pass


class _PingPong:
    """Two flat byte buffers on ``device`` that buckets take in turn (bucket ``k`` uses buffer ``k % 2``), each
    reallocated when a bucket does not fit."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None, None]

    def fill(self, k: int, bucket: Bucket) -> tuple[torch.Tensor, list[dict], bool]:
        """Flatten bucket ``k`` into its buffer: the filled front of it, the layout, and whether the buffer is new."""
        old = self.buffers[k % 2]
        buffer, layout = flatten_bucket(bucket, self.device, old)
        add_checksums(buffer, layout)  # what the receiver must find (also waits for the copies)
        new = old is None or buffer.data_ptr() != old.data_ptr()
        if new:
            self.buffers[k % 2] = buffer
        return buffer, layout, new


def _at_least_one(stream: Iterator[tuple[Bucket, bool]]) -> Iterator[tuple[Bucket, bool]]:
    """``stream``, or one empty final bucket if it has none (the engines' receive loop ends on a final one)."""
    empty = True
    for item in stream:
        empty = False
        yield item
    if empty:
        yield [], True


def _wait_sent(works: list[dist.Work], answers: concurrent.futures.Future) -> None:
    """Wait until ``works`` (broadcasts from this rank) have ended, raising the engines' error if their answers
    (``answers``) come first with one: a receiver that failed would otherwise leave the broadcast waiting until the
    group's timeout."""

    def raise_engines_error() -> None:
        if answers.done() and answers.exception() is not None:
            raise answers.exception()

    poll_works(works, raise_engines_error, 0.0)
    try:
        for work in works:
            work.wait()
    except Exception as broadcast_error:  # a receiver went away: its engine's answer says which and why
        try:
            answers.result(timeout=10)
        except concurrent.futures.TimeoutError:
            pass
        except Exception as engine_error:
            raise engine_error from broadcast_error
        raise


def _wait(
    future: concurrent.futures.Future | None, phases: MovePhases, urls: Sequence[str]
) -> BaseException | None:
    """Wait for the answers of the engines at ``urls`` to a bucket (timed as ``engine_wait_s``); their exception
    (a rejection included), or None."""
    if future is None:
        return None
    try:
        phases.wait("engine_wait_s", future, urls)
    except Exception as exc:  # every rank must hear of it, or they wait at the next bucket
        return exc
    return None


def _agree_on(error: BaseException | None) -> None:
    """Share rank 0's error (or None) with every rank; all raise together."""
    status: list = [None] * dist.get_world_size()
    dist.all_gather_object(status, None if error is None else repr(error))
    if error is not None:
        raise error
    if status[0] is not None:
        raise RuntimeError(f"weight sync failed on training rank 0: {status[0]}")
