"""vLLM worker extension for the ``distributed`` and ``tensor`` weight-sync transports (DESIGN.md §5), and the
weight process group the ``distributed`` one builds on both sides.

Start engines with ``--worker-extension-cls vime.backends.vllm_utils.worker_extension.VimeWorkerExtension``;
vLLM mixes the class into every worker, so its methods run on each worker through ``POST /collective_rpc``
(``self`` is the vLLM worker: ``self.rank``, ``self.reload_weights``). vLLM passes the JSON
body's ``args``/``kwargs`` through unchanged, so the arguments here are JSON values (dtypes as strings).

The weight group is a standalone process group (a ``TCPStore`` hosted by the trainer's rank 0 plus a
``ProcessGroupGloo``/``ProcessGroupNCCL``): rank 0 is the trainer's sender, engine workers are ranks
``rank_offset + worker rank``. It never touches vLLM's own default group or the trainer's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from vime.backends.vllm_utils.cuda_ipc import open_cuda_buffer
from vime.backends.vllm_utils.stacked_expert_loader import load_weights
from vime.utils.distributed import tcp_store
from vime.utils.stacked_experts import expand_stacked
from vime.utils.weight_buckets import tensor_checksums, unflatten_bucket, verify_checksums

# under vLLM's logger, so that its lines land in the engine's log in vLLM's format
logger = logging.getLogger("vllm.vime.weight_sync")
STORE_PREFIX = "vime_weight_sync"
# The disk transport's proof that an engine reads the directory the trainer wrote.
SYNC_TOKEN_FILE = "vime_sync_token.txt"


# A worker waiting on the weight group asks the store for rank 0's abort key this often (the sync it waits in may
# have been given up).
ABORT_CHECK_S = 0.01
ABORT_KEY = f"{STORE_PREFIX}/abort"


class SyncAborted(RuntimeError):
    """The sync a worker was receiving ended without it: rank 0 gave it up (its abort key in the store), rank 0 is
    gone (the store with it), or a collective of the weight group failed."""


def poll_works(works: Sequence[dist.Work], check: Callable[[], None], check_every_s: float) -> None:
    """Return once every one of ``works`` has ended, calling ``check`` (it raises to give the wait up) whenever
    ``check_every_s`` have passed since the last call. Polled, not a blocking ``wait``: a collective whose peer died
    never ends with NCCL, and only at the group's timeout with gloo."""
    checked = time.monotonic()
    while not all(work.is_completed() for work in works):
        if time.monotonic() - checked >= check_every_s:
            check()
            checked = time.monotonic()
        time.sleep(0.0002)


@dataclass
class WeightGroup:
    """One member of the weight process group: the group, the store it was built on (kept alive with it), the
    device its tensors must live on, and the collectives it started that may not have ended yet."""

    store: dist.Store
    group: dist.ProcessGroup
    device: torch.device
    works: list[dist.Work] = field(default_factory=list)

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        """Start broadcasting ``tensor`` from rank 0 (in place on the receivers); ``.wait()`` the result."""
        work = self.group.broadcast(tensor, 0)
        self.works = [*(w for w in self.works if not w.is_completed()), work]
        return work

    def send_header(self, header: dict) -> list[dist.Work]:
        """Rank 0: start broadcasting ``header`` (JSON) ahead of a bucket; keep the returned works until they end."""
        body = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(self.device)
        size = torch.tensor([body.numel()], dtype=torch.int64, device=self.device)
        return [self.group.broadcast(size, 0), self.group.broadcast(body, 0)]

    def receive_header(self) -> dict:
        """The next header rank 0 sent with :meth:`send_header` (waits for it as :meth:`wait` does)."""
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        self.wait(self.broadcast(size))
        body = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.wait(self.broadcast(body))
        return json.loads(body.cpu().numpy().tobytes())

    def wait(self, work: dist.Work) -> None:
        """Wait for ``work`` (a collective this worker takes part in) to end, asking the store every
        ``ABORT_CHECK_S`` whether rank 0 gave the sync up: :class:`SyncAborted` then, when the store is gone, or when
        the collective failed. A worker never waits on a sync that rank 0 gave up."""
        poll_works([work], self._raise_if_given_up, ABORT_CHECK_S)
        try:
            work.wait()
        except RuntimeError as exc:
            raise SyncAborted(f"a collective of the weight group failed: {exc}") from exc

    def _raise_if_given_up(self) -> None:
        try:
            aborted = self.store.check([ABORT_KEY])
        except dist.DistError as exc:
            raise SyncAborted(f"the weight group's store (the trainer's rank 0) is gone: {exc}") from exc
        if aborted:
            raise SyncAborted(f"the trainer gave the sync up: {self.store.get(ABORT_KEY).decode()}")

    def idle(self) -> bool:
        """Whether every collective this member started has ended."""
        return all(work.is_completed() for work in self.works)

    def abort(self) -> None:
        """Abort this member's communicator: with NCCL its pending kernels end (a receive whose sender gave up never
        would); with gloo a pending receive still ends only when rank 0 drops its member or at the timeout."""
        self.group.abort()

    def close(self, reason: str) -> None:
        """Rank 0, before dropping its member: workers waiting in a sync are told to leave it (the store's abort key,
        with ``reason``: :meth:`wait`), then the communicator is aborted (NCCL: ``shutdown`` would wait for pending
        kernels, forever if a member died). With gloo it is the member's destruction that closes its connections,
        failing the workers' pending receives (torch 2.13: neither ``abort`` nor ``shutdown`` does)."""
        self.store.set(ABORT_KEY, reason)
        self.abort()


def create_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float = 600.0,
    listener: socket.socket | None = None,
) -> WeightGroup:
    """Join the weight group as ``rank`` (rank 0 hosts the store, on ``listener`` if given: a socket bound to
    ``master_address:master_port`` only). With gloo the call returns once every rank has joined; the backend is
    chosen here and only here: ``gloo`` (CPU tensors) or ``nccl`` (current CUDA device)."""
    timeout = timedelta(seconds=timeout_s)
    store = (
        tcp_store(master_address, master_port, world_size, timeout, listener)
        if rank == 0
        else dist.TCPStore(master_address, master_port, world_size, False, timeout=timeout)
    )
    prefixed = dist.PrefixStore(STORE_PREFIX, store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        device = torch.device("cpu")
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        device = torch.device("cuda", torch.cuda.current_device())
        # NCCL builds its communicator at the first collective, blocking until every rank is there. Do it now,
        # while all ranks are joining: the trainer issues later broadcasts before the engines hear of them.
        group.broadcast(torch.zeros(1, device=device), 0).wait()
        torch.cuda.synchronize(device)
    else:
        raise ValueError(f"weight-sync backend must be 'gloo' or 'nccl', not {backend!r}")
    return WeightGroup(store, group, device)


def parse_dtype(name: str) -> torch.dtype:
    """``"float32"`` (or ``"torch.float32"``) -> ``torch.float32``."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r} in a weight-sync bucket")
    return dtype


class VimeWorkerExtension:
    """Methods mixed into each vLLM worker (called via ``collective_rpc``); see the module docstring."""

    _vime_weight_group: WeightGroup | None = None

    def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str,
        timeout_s: float = 600.0,
    ) -> None:
        """Join the trainer's weight group as rank ``rank_offset + self.rank``; blocks until all ranks join."""
        self._vime_drop_retired_groups()
        self._vime_weight_group = create_weight_group(
            master_address,
            int(master_port),
            int(rank_offset) + self.rank,
            int(world_size),
            backend,
            timeout_s,
        )

    def receive_weights_stream(self) -> dict:
        """``distributed``: receive and load every bucket of one sync, in one call. Rank 0 broadcasts per bucket a
        header (``layout``: ``weight_buckets.bucket_layout``, ``nbytes``, ``final``) and the bucket flattened into
        ``nbytes`` bytes; bucket k is loaded while bucket k+1 arrives (two buffers in flight). Returns this worker's
        ``receive_s`` (waiting for data, headers included) and ``load_s``; or ``rejected`` (see
        :meth:`_vime_check_and_load`; the later buckets of the sync are then received and dropped); or ``aborted``
        when the sync ended without this worker (:class:`SyncAborted`: e.g. another engine died and rank 0 gave the
        sync up). Then the buckets staged so far are dropped (on GPU those loaded stay: the retry or the next sync
        sends every bucket again) and so is the group, whose collectives may still be pending: the next sync joins a
        new one."""
        group = self._vime_weight_group
        if group is None:
            raise RuntimeError("receive_weights_stream before init_weight_update_group")
        try:
            return self._vime_receive_stream(group)
        except BaseException as exc:
            self.__dict__.pop("_vime_staged_weights", None)
            self._vime_weight_group = None
            group.abort()
            self.__dict__.setdefault("_vime_retired_groups", []).append(group)
            if not isinstance(exc, SyncAborted):
                raise
            logger.warning("vime weight sync: left the sync: %s", str(exc))
            return {"aborted": str(exc)}

    def _vime_receive_stream(self, group: WeightGroup) -> dict:
        stats: Counter = Counter()
        rejected: str | None = None
        pending = None
        final = False
        while not final:
            started = time.perf_counter()
            header = group.receive_header()
            buffer = torch.empty(int(header["nbytes"]), dtype=torch.uint8, device=group.device)
            arriving = (group.broadcast(buffer), buffer, header)
            stats["receive_s"] += time.perf_counter() - started
            if pending is not None:
                rejected = self._vime_receive_and_load(group, *pending, stats, rejected)
            pending, final = arriving, bool(header["final"])
        rejected = self._vime_receive_and_load(group, *pending, stats, rejected)
        return {"rejected": rejected} if rejected else dict(stats)

    def _vime_receive_and_load(
        self,
        group: WeightGroup,
        work: dist.Work,
        buffer: torch.Tensor,
        header: dict,
        stats: Counter,
        rejected: str | None,
    ) -> str | None:
        """Wait for ``buffer`` to arrive, then check and load it unless an earlier bucket of the sync was
        ``rejected``; the sync's rejection so far."""
        started = time.perf_counter()
        group.wait(work)
        if buffer.is_cuda:
            torch.cuda.current_stream(buffer.device).synchronize()  # received, not only queued
        received = time.perf_counter()
        stats["receive_s"] += received - started
        if rejected is None:
            rejected = self._vime_check_and_load(buffer, header["layout"], bool(header["final"]))
            stats["load_s"] += time.perf_counter() - received
        return rejected

    def _vime_drop_retired_groups(self) -> None:
        """Drop the groups of syncs this worker left (:meth:`receive_weights_stream`) whose collectives have ended:
        ProcessGroupGloo's destructor would wait for a pending receive (up to the group's timeout)."""
        retired = self.__dict__.get("_vime_retired_groups", [])
        retired[:] = [group for group in retired if not group.idle()]

    def update_weights_from_ipc(self, buffers: list[dict], final: bool = True) -> dict:
        """``tensor`` transport: map this worker's entry of ``buffers`` (``{"handle", "layout"}``, one per engine
        worker, shared by the training rank on the same GPU) and load the bucket from it. A buffer stays mapped
        until the ``final`` bucket of the sync (the sender reuses two buffers for every bucket). Returns this
        worker's ``load_s`` (mapping included), or ``rejected`` (see :meth:`_vime_check_and_load`)."""
        started = time.perf_counter()
        entry = buffers[self.rank]
        mapped = self.__dict__.setdefault("_vime_ipc_buffers", {})
        key = json.dumps(entry["handle"], sort_keys=True)
        if key not in mapped:
            mapped[key] = open_cuda_buffer(entry["handle"])
        rejected = self._vime_check_and_load(mapped[key], entry["layout"], final)
        if final or rejected:
            mapped.clear()
            torch.cuda.ipc_collect()
        return {"rejected": rejected} if rejected else {"load_s": time.perf_counter() - started}

    def _vime_check_and_load(self, buffer: torch.Tensor, layout: list[dict], final: bool) -> str | None:
        """Check the bucket's checksums, then load it; or, when a tensor arrived changed (on the way, or in a
        staging buffer the trainer reused too early), load nothing, drop the buckets staged so far in this sync and
        return why (the trainer fails the sync naming the engine and the tensor). Returned, not raised: vLLM ends
        the engine when a ``collective_rpc`` raises, and this engine is sound, only this sync's data is not."""
        try:
            verify_checksums(buffer, layout)
        except ValueError as exc:
            self.__dict__.pop("_vime_staged_weights", None)
            self.__dict__.pop("_vime_stacked_counts", None)  # the next sync counts its own stacked tensors
            logger.error("vime weight sync: bucket rejected: %s", exc)
            return str(exc)
        self._vime_load(unflatten_bucket(buffer, layout), final)
        return None

    def _vime_load(self, weights: list[tuple[str, torch.Tensor]], final: bool) -> None:
        """Load one bucket of HF-named weights and stacked experts (``vime.utils.stacked_experts``). On GPU straight
        into the model (``stacked_expert_loader.load_weights``: the loads copy, so the bucket's buffer can go). On CPU
        vLLM repacks loaded weights into kernel formats and drops their loaders, so buckets are kept (stacked experts
        as HF per-expert views) until the ``final`` one and the whole model is reloaded at once (its layer-wise
        reload also treats layers missing from a partial iterator as failed)."""
        if torch.cuda.is_available():
            written, expanded = load_weights(self.model_runner.get_model(), weights)
            torch.cuda.synchronize()
            stacked = self.__dict__.setdefault("_vime_stacked_counts", Counter())
            stacked.update(written=written, expanded=expanded)
            if final and stacked.total():
                logger.info(
                    "vime weight sync: %d stacked expert tensors written into fused-MoE layers, %d loaded per expert",
                    stacked["written"],
                    stacked["expanded"],
                )
                stacked.clear()
            return
        staged = self.__dict__.setdefault("_vime_staged_weights", [])
        staged.extend(expand_stacked(weights))
        if final:
            self.reload_weights(weights_iterator=list(staged), is_checkpoint_format=True)
            staged.clear()
            _prepack_cpu_experts(self.model_runner.get_model())

    def reload_weights_from_path(self, weights_path: str) -> None:
        """``disk``: reload the HF safetensors in ``weights_path``; on CPU the fused-MoE weights are prepacked again,
        as after any reload (:func:`_prepack_cpu_experts`)."""
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        if not torch.cuda.is_available():
            _prepack_cpu_experts(self.model_runner.get_model())

    def record_weights_checksums(self, version: int) -> dict:
        """At the end of the sync that loaded weight version ``version`` (engine paused): remember the checksum of each
        of this worker's parameters in vLLM's layout (its tensor-parallel shard, fused qkv/gate_up, stacked experts,
        as vLLM's loaders wrote them from bytes the transit checksums proved to be the trainer's), for
        :meth:`check_weights_checksums`. Returns ``{"parameters": n}``, or ``{"error": why}`` (not raised: see
        :meth:`_vime_check_and_load`)."""
        try:
            names, sums, _ = self._vime_parameter_checksums()
        except Exception as exc:  # noqa: BLE001 - answered, not raised
            logger.exception("vime weights check: recording the checksums failed")
            return {"error": f"{type(exc).__name__}: {exc}"}
        self._vime_recorded = {"version": int(version), "checksums": dict(zip(names, sums, strict=True))}
        return {"parameters": len(names)}

    def check_weights_checksums(self) -> dict:
        """This worker's weights report for the weights check (``vime.utils.weight_check.compare_checksums``):
        ``version`` (of the last recorded sync; None when none since the engine started), ``names`` and
        ``checksums`` of its parameters now, their ``layout`` (a digest of names, shapes and dtypes), and ``changed``: the first parameter whose checksum differs from the
        recorded one (``[name, recorded, now]``; a parameter added or gone counts, recorded or now then None), or
        None. Or ``{"error": why}``."""
        try:
            names, sums, layout = self._vime_parameter_checksums()
        except Exception as exc:  # noqa: BLE001 - answered, not raised
            logger.exception("vime weights check: reading the checksums failed")
            return {"error": f"{type(exc).__name__}: {exc}"}
        recorded = self.__dict__.get("_vime_recorded")
        if recorded is None:
            return {"version": None, "names": names, "checksums": sums, "layout": layout, "changed": None}
        before, now = recorded["checksums"], dict(zip(names, sums, strict=True))
        changed = next(
            (
                [name, before.get(name), now.get(name)]
                for name in [*before, *now]
                if before.get(name) != now.get(name)
            ),
            None,
        )
        return {
            "version": recorded["version"], "names": names, "checksums": sums, "layout": layout, "changed": changed,
        }  # fmt: skip

    def _vime_parameter_checksums(self) -> tuple[list[str], list[int], str]:
        """This worker's parameters' names, checksums and layout digest (names, shapes, dtypes) (``weight_buckets.tensor_checksums``: integer word sums
        computed where the parameters live, one transfer). On CPU vLLM moves most linear weights into its GEMM
        kernels' own packed form after loading (the parameter left empty): there the check covers the rest
        (embeddings, norms, the LM head) and the log-prob probe covers the whole model."""
        named = list(self.model_runner.get_model().named_parameters())
        shapes = [(name, list(param.shape), str(param.dtype)) for name, param in named]
        layout = hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]
        return [name for name, _ in named], tensor_checksums(param for _, param in named), layout

    def read_sync_token(self, path: str) -> str | None:
        """The ``disk`` transport's token file as this worker's node sees it (None if it cannot read it)."""
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return None

    def destroy_weight_update_group(self) -> None:
        """Leave the weight group (drop this worker's members of it)."""
        self._vime_weight_group = None


def _prepack_cpu_experts(model: torch.nn.Module) -> None:
    """vLLM 0.32 on CPU prepacks fused-MoE weights into its kernel's layout after the first load only: a reload
    (a weight update) leaves them in the loaded layout, which the kernel misreads. Prepack them again."""
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(module)
