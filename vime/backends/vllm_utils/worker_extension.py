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
from dataclasses import dataclass
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


@dataclass
class WeightGroup:
    """One member of the weight process group: the group, the store it was built on (kept alive with it) and
    the device its tensors must live on."""

    store: dist.Store
    group: dist.ProcessGroup
    device: torch.device

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        """Start broadcasting ``tensor`` from rank 0 (in place on the receivers); ``.wait()`` the result."""
        return self.group.broadcast(tensor, 0)

    def close(self) -> None:
        """Leave the group, closing its connections: with gloo a member waiting in a collective with this one then
        fails at once instead of timing out (``abort`` would leave it waiting)."""
        self.group.shutdown()


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
        self._vime_weight_group = create_weight_group(
            master_address,
            int(master_port),
            int(rank_offset) + self.rank,
            int(world_size),
            backend,
            timeout_s,
        )

    def update_weights_from_distributed(self, layout: list[dict], nbytes: int, final: bool = True) -> dict:
        """Receive one bucket, flattened into ``nbytes`` bytes (``layout``: ``weight_buckets.bucket_layout``),
        broadcast from rank 0, and load it. Returns this worker's ``receive_s`` and ``load_s``, or ``rejected``
        (see :meth:`_vime_check_and_load`)."""
        group = self._vime_weight_group
        if group is None:
            raise RuntimeError("update_weights_from_distributed before init_weight_update_group")
        started = time.perf_counter()
        buffer = torch.empty(int(nbytes), dtype=torch.uint8, device=group.device)
        group.broadcast(buffer).wait()
        if buffer.is_cuda:
            torch.cuda.synchronize(buffer.device)  # received, not only queued
        received = time.perf_counter()
        if rejected := self._vime_check_and_load(buffer, layout, final):
            return {"rejected": rejected}
        return {"receive_s": received - started, "load_s": time.perf_counter() - received}

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
