"""HF-named full weights out of an FSDP2-sharded model, for weight sync and HF export."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from vime.utils.weight_buckets import Bucket, in_buckets


def hf_weight_names(model: nn.Module) -> list[str]:
    """The model's state-dict names as an HF checkpoint holds them: parameters and persistent buffers, each tied
    parameter once under its first name (e.g. ``model.embed_tokens.weight``, not the tied ``lm_head.weight``)."""
    all_params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    unique_params = {name for name, _ in model.named_parameters()}
    aliases = all_params - unique_params
    return [name for name in model.state_dict() if name not in aliases]


def iter_weight_buckets(model: nn.Module, buffer_bytes: int, dtype: torch.dtype) -> Iterator[Bucket]:
    """Yield lists of ``(hf_name, full_tensor)`` of at most ``buffer_bytes`` each (a larger tensor is a bucket of
    its own), floating-point tensors cast to ``dtype``.

    Collective: every rank must iterate to the end, in step, because each sharded tensor is all-gathered; the
    tensors are complete on every rank. Only one bucket of full tensors is alive at a time.
    """
    state = model.state_dict()

    def full_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name in hf_weight_names(model):
            tensor = state[name]
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield name, full.detach().to(dtype) if full.is_floating_point() else full.detach()

    return in_buckets(full_tensors(), buffer_bytes)
