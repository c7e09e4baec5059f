"""Training state off the GPU while the engines generate (``--offload-train``), for either backend.

:class:`GPUOffloader` works on storages, not modules: every tensor it is given keeps its identity (the optimizer,
FSDP and Megatron's buffers keep their references), while the GPU memory behind it goes back to the driver.
``keep`` tensors are copied to pinned host memory first and copied back on :meth:`onload`; ``discard`` tensors
(gradient buffers, rewritten before they are next read) are only freed and reallocated. Views sharing one storage
(Megatron's parameter and gradient buffers) are handled once.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The ``torch.optim`` optimizers inside ``optimizer`` (itself, or Megatron's wrappers and chains of them). Of
    Megatron-Core's ``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``), the CPU and GPU optimizers it steps: they
    hold the fp32 copies and the moments, on their own devices."""
    if hasattr(optimizer, "sub_optimizers"):
        return list(optimizer.sub_optimizers)
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if hasattr(optimizer, "chained_optimizers"):
        return [inner for chained in optimizer.chained_optimizers for inner in torch_optimizers(chained)]
    if hasattr(optimizer, "optimizer"):
        return torch_optimizers(optimizer.optimizer)
    raise TypeError(f"cannot find the torch optimizer inside {type(optimizer).__name__}")


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The parameters an optimizer updates (e.g. Megatron's fp32 main copies) and its state (Adam moments)."""
    tensors = []
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            tensors.extend(group["params"])
        for state in inner.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


class GPUOffloader:
    """Frees the GPU storage behind given tensors and brings it back, in place (see the module docstring)."""

    def __init__(self):
        self._host: dict[int, torch.Tensor] = {}  # pinned copies, reused from one offload to the next
        self._freed: list[tuple[torch.UntypedStorage, int, bool]] = []  # (storage, bytes, copied to host)

    @property
    def offloaded(self) -> bool:
        return bool(self._freed)

    def offload(
        self, keep: Iterable[torch.Tensor | None], discard: Iterable[torch.Tensor | None] = ()
    ) -> dict:
        """Free the GPU storage behind ``keep`` (saved to host first) and ``discard`` (not saved); returns
        ``offload/freed_gib`` (what the CUDA driver got back) and ``time/offload_s``."""
        if self._freed:
            raise RuntimeError("offload() twice without onload()")
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        seen: set[int] = set()
        for tensors, save in ((keep, True), (discard, False)):
            for tensor in tensors:
                if isinstance(tensor, DTensor):  # FSDP2: this rank's shard
                    tensor = tensor.to_local()
                if tensor is None or not tensor.is_cuda:
                    continue
                storage = tensor.untyped_storage()
                if storage._cdata in seen or storage.nbytes() == 0:
                    continue
                seen.add(storage._cdata)
                if save:
                    host = self._host.get(storage._cdata)
                    if host is None or host.numel() != storage.nbytes():
                        host = self._host[storage._cdata] = torch.empty(
                            storage.nbytes(), dtype=torch.uint8, pin_memory=True
                        )
                    host.untyped_storage().copy_(storage, non_blocking=True)
                self._freed.append((storage, storage.nbytes(), save))
        torch.cuda.synchronize()
        for storage, _, _ in self._freed:
            storage.resize_(0)
        torch.cuda.empty_cache()
        freed = torch.cuda.mem_get_info()[0] - free_before
        return {"offload/freed_gib": freed / 2**30, "time/offload_s": time.perf_counter() - started}

    def onload(self) -> dict:
        """Reallocate every freed storage and copy the saved ones back; returns ``time/onload_s``."""
        started = time.perf_counter()
        for storage, nbytes, saved in self._freed:
            storage.resize_(nbytes)
            if saved:
                storage.copy_(self._host[storage._cdata].untyped_storage(), non_blocking=True)
        torch.cuda.synchronize()
        self._freed = []
        return {"time/onload_s": time.perf_counter() - started}


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (FSDP2's DTensor), else the parameter."""
    return param.to_local() if isinstance(param, DTensor) else param


@torch.no_grad()
def copy_weights(target: torch.nn.Module, source) -> None:
    """Copy ``source`` (``(name, tensor)`` pairs named as ``target``'s parameters: sharded alike, full, or on the
    host) into ``target``'s parameters, shard by shard (a reference or old-actor copy of the policy)."""
    weights = dict(source)
    for name, param in target.named_parameters():
        value = weights[name]
        if isinstance(param, DTensor):
            param.to_local().copy_(local_shard(value))
        else:
            param.copy_(value.full_tensor() if isinstance(value, DTensor) else value)
