"""HF-named full weights out of an FSDP2-sharded model, for weight sync and HF export."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def hf_weight_names(model: nn.Module) -> list[str]:
    """The model's state-dict names as an HF checkpoint holds them: parameters and persistent buffers, each tied
    parameter once under its first name (e.g. ``model.embed_tokens.weight``, not the tied ``lm_head.weight``)."""
    all_params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    unique_params = {name for name, _ in model.named_parameters()}
    aliases = all_params - unique_params
    return [name for name in model.state_dict() if name not in aliases]


def iter_weight_buckets(
    model: nn.Module, buffer_bytes: int, dtype: torch.dtype
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of ``(hf_name, full_tensor)`` of at most ``buffer_bytes`` each (a larger tensor is a bucket of
    its own), floating-point tensors cast to ``dtype``.

    Collective: every rank must iterate to the end, in step, because each sharded tensor is all-gathered; the
    tensors are complete on every rank. Only one bucket of full tensors is alive at a time.
    """
    state = model.state_dict()
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name in hf_weight_names(model):
        tensor = state[name]
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        full = full.detach().to(dtype) if full.is_floating_point() else full.detach()
        nbytes = full.numel() * full.element_size()
        if bucket and size + nbytes > buffer_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, full))
        size += nbytes
    if bucket:
        yield bucket
