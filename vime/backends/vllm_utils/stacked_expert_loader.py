"""Inside a vLLM worker: write stacked expert weights (``vime.utils.stacked_experts``) straight into a fused-MoE
layer's ``w13_weight``/``w2_weight``, three copies per layer instead of one ``weight_loader`` call per expert.

The copies go through the parameter's own ``weight_loader`` with the 3-D (all local experts) tensor, the form vLLM
loads fused checkpoints with: vLLM narrows to this rank's slice of the intermediate dimension (TP) and puts gate and
up into their halves of ``w13``. What is left to vime is choosing this rank's experts (engine EP) in local order.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vime.utils.stacked_experts import W13, expand_stacked, parse_stacked

Weights = Iterable[tuple[str, torch.Tensor]]


def load_weights(model: nn.Module, weights: Weights) -> tuple[int, int]:
    """Load one bucket into ``model``: stacked experts of a layer vime can write (:func:`fused_experts`) directly,
    the other stacked experts expanded to HF per-expert views, and everything else through ``model.load_weights``.
    Returns how many stacked tensors were written directly and how many were expanded."""
    per_name = []
    written = expanded = 0
    for name, tensor in weights:
        parsed = parse_stacked(name)
        layer = fused_experts(model, parsed[0]) if parsed else None
        if layer is not None:
            write_stacked(layer, parsed[1], tensor)
            written += 1
            continue
        per_name.append((name, tensor))
        expanded += parsed is not None
    if per_name:
        model.load_weights(weights=list(expand_stacked(per_name)))
    return written, expanded


def fused_experts(model: nn.Module, experts: str) -> nn.Module | None:
    """The module holding the fused expert parameters of the HF module path ``experts``, if ``model`` has one
    (vLLM >= 0.25 keeps them in the MoE runner's ``routed_experts``); None when the model names its modules otherwise
    (then the per-expert HF names go through ``load_weights``). Raises if the layer is not unquantized and gated
    (gate and up in ``w13``), which the stacked bf16 weights cannot be written into."""
    try:
        module = model.get_submodule(experts)
    except AttributeError:
        return None
    module = getattr(module, "routed_experts", module)
    if not isinstance(getattr(module, "w13_weight", None), nn.Parameter):
        return None
    # vLLM is there inside its workers; the trainer side imports this module without it (worker_extension)
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    config = module.moe_config
    problems = []
    if not isinstance(module.quant_method, UnquantizedFusedMoEMethod):
        problems.append(f"quantized ({type(module.quant_method).__name__})")
    if not config.is_act_and_mul:
        problems.append(f"not gated (activation {config.activation})")
    if config.num_experts != config.num_logical_experts:
        problems.append(f"{config.num_experts - config.num_logical_experts} redundant experts (EPLB)")
    if problems:
        raise ValueError(
            f"vLLM MoE layer {experts}: {', '.join(problems)}; vime's weight sync writes unquantized gated experts "
            "without redundant copies: serve the model unquantized, without --enable-eplb"
        )
    return module


def write_stacked(layer: nn.Module, proj: str, stacked: torch.Tensor) -> None:
    """Write a stacked ``w13`` ``[E, 2I, H]`` or ``w2`` ``[E, H, I]`` (every global expert, full intermediate size)
    into ``layer``'s local experts, what the per-expert ``weight_loader`` calls would write."""
    if stacked.shape[0] != layer.global_num_experts:
        raise ValueError(
            f"vLLM MoE layer {layer.layer_name}: a stacked {proj} of {stacked.shape[0]} experts, the engine has "
            f"{layer.global_num_experts}: do trainer and engine load the same model?"
        )
    ids = global_ids(layer)
    local = local_experts(stacked, ids)
    param = layer.w13_weight if proj == W13 else layer.w2_weight
    # expert_id only tells the loader the experts are this rank's; with a 3-D tensor it loads all local ones
    first = int(ids[0])
    shards = zip(("w1", "w3"), local.chunk(2, dim=1), strict=True) if proj == W13 else [("w2", local)]
    for shard_id, loaded in shards:
        param.weight_loader(param, loaded, f"{proj}_weight", shard_id=shard_id, expert_id=first)


def global_ids(layer: nn.Module) -> torch.Tensor:
    """The global expert id of each local expert of ``layer``, in local order."""
    expert_map = layer.expert_map  # global -> local id, -1 elsewhere; None without EP
    if expert_map is None:
        return torch.arange(layer.local_num_experts)
    expert_map = expert_map.cpu()
    held = torch.nonzero(expert_map >= 0).flatten()
    ids = torch.empty_like(held)
    ids[expert_map[held].long()] = held
    return ids


def local_experts(stacked: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``stacked``'s rows ``ids`` (global ids of the local experts): a view when they are consecutive (no EP, or
    linear placement), else a copy."""
    first = int(ids[0])
    if torch.equal(ids, torch.arange(first, first + len(ids))):
        return stacked.narrow(0, first, len(ids))
    return stacked.index_select(0, ids.to(stacked.device))
