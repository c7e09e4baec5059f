"""HF-named full weights out of an FSDP2-sharded model, for weight sync and HF export.

transformers may hold weights in memory in another layout than its checkpoints: MoE models (qwen3_moe, glm4_moe, ...)
fuse their experts into ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I], while
checkpoints, ``save_pretrained`` and vLLM's loaders use ``mlp.experts.{e}.{gate,up,down}_proj.weight``.
:func:`checkpoint_format` maps the former to the latter, with the reverse of the conversion transformers applied on
load. The former is also vime's stacked-expert format (``vime.utils.stacked_experts``), which weight sync sends as is.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import revert_weight_conversion

from vime.utils.stacked_experts import W2, W13, stacked_name
from vime.utils.weight_buckets import Bucket, in_buckets

# transformers' conversions whose in-memory experts are vime's stacked layout: per expert, gate rows then up rows
# ([E, 2I, H]), and down_proj as is ([E, H, I])
_STACKED_CONVERSIONS = {
    "mlp.experts.gate_up_proj": (W13, [("MergeModulelist", 0), ("Concatenate", 1)]),
    "mlp.experts.down_proj": (W2, [("MergeModulelist", 0)]),
}


def hf_weight_names(model: nn.Module) -> list[str]:
    """The model's state-dict names (in-memory layout) of the weights an HF checkpoint holds: parameters and
    persistent buffers, each tied parameter once under its first name (e.g. ``model.embed_tokens.weight``, not the
    tied ``lm_head.weight``)."""
    all_params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    unique_params = {name for name, _ in model.named_parameters()}
    aliases = all_params - unique_params
    return [name for name in model.state_dict() if name not in aliases]


def checkpoint_format(
    model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], stack_experts: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Map in-memory ``(name, full_tensor)`` pairs to the names and layout ``save_pretrained`` writes, one tensor at
    a time: a fused MoE expert tensor becomes one tensor per expert (and projection) — or, with ``stack_experts``
    and a layout :func:`stacked_suffixes` knows, keeps its tensor under its stacked key; other tensors pass through
    unchanged.

    Raises ``NotImplementedError`` where two tensors map to one checkpoint name: such a conversion (e.g. q/k/v
    fused on disk, separate in memory) needs its tensors together; qwen3, qwen3_moe, llama and glm4_moe have none.
    """
    stacked = stacked_suffixes(model) if stack_experts else {}
    seen: set[str] = set()
    for name, tensor in named_tensors:
        module, _, suffix = name.rpartition(".mlp.experts.")
        if module and f"mlp.experts.{suffix}" in stacked:
            yield stacked_name(f"{module}.mlp.experts", stacked[f"mlp.experts.{suffix}"]), tensor
            continue
        for hf_name, hf_tensor in revert_weight_conversion(model, {name: tensor}).items():
            if hf_name in seen:
                raise NotImplementedError(
                    f"{type(model).__name__}: {hf_name!r} is built from several in-memory tensors; "
                    "converting such weights to the checkpoint format is not supported"
                )
            seen.add(hf_name)
            yield hf_name, hf_tensor


def stacked_suffixes(model: nn.Module) -> dict[str, str]:
    """In-memory expert name suffixes that are already stacked (``{"mlp.experts.gate_up_proj": "w13", ...}``):
    those whose checkpoint conversion is exactly the per-expert stacking (empty for models without fused experts,
    or whose experts are stored otherwise, e.g. transposed)."""
    stacked = {}
    for converter in get_checkpoint_conversion_mapping(model.config.model_type) or []:
        operations = [
            (type(op).__name__, getattr(op, "dim", None)) for op in getattr(converter, "operations", [])
        ]
        for target in converter.target_patterns:
            proj, wanted = _STACKED_CONVERSIONS.get(target, (None, None))
            if proj is not None and operations == wanted:
                stacked[target] = proj
    return stacked


def iter_weight_buckets(
    model: nn.Module, buffer_bytes: int, dtype: torch.dtype, stack_experts: bool = False
) -> Iterator[Bucket]:
    """Yield lists of ``(hf_name, full_tensor)`` in the checkpoint format (see :func:`checkpoint_format`) of at
    most ``buffer_bytes`` each (a larger tensor is a bucket of its own), floating-point tensors cast to ``dtype``.

    Collective: every rank must iterate to the end, in step, because each sharded tensor is all-gathered; the
    tensors are complete on every rank. Only one bucket of full tensors (and the in-memory tensor it was split
    from) is alive at a time.
    """
    state = model.state_dict()

    def full_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name in hf_weight_names(model):
            tensor = state[name]
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield name, full.detach().to(dtype) if full.is_floating_point() else full.detach()

    return in_buckets(checkpoint_format(model, full_tensors(), stack_experts), buffer_bytes)
