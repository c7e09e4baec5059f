"""Routing replay on Hugging Face MoE models (``vime.utils.routing_replay``): a forward hook on each router.

The routers handled return ``(logits, weights, indices)`` (transformers 5) and compute their weights in one of two
ways: softmax routers (Qwen3-MoE, Qwen2-MoE, OLMoE, Qwen3-Next) take ``softmax(logits)`` over all experts in fp32,
pick the top-k, renormalise them when ``norm_topk_prob`` and cast to the logits' dtype; sigmoid routers
(DeepSeek-V3, GLM-4.5) pick the top-k of ``sigmoid(logits)`` plus the expert bias (within the best expert groups),
and weigh each by its sigmoid score without the bias, renormalised when ``norm_topk_prob``, times
``routed_scaling_factor``. The hook keeps the router's logits, asks the :class:`RoutingReplay` which experts to use,
and recomputes the weights the same way over those experts: with the router's own choice the output is bitwise what
the router returned.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from vime.utils.routing_replay import RoutingReplay

# transformers router classes that compute their gate weights as described above
SOFTMAX_ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter", "Qwen3NextTopKRouter")
SIGMOID_ROUTERS = ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter")
SUPPORTED_ROUTERS = SOFTMAX_ROUTERS + SIGMOID_ROUTERS
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def router_modules(model: nn.Module) -> dict[int, nn.Module]:
    """The MoE routers of ``model`` by decoder-layer index (empty for a dense model). A router of a class
    vime cannot replay raises, naming the supported ones."""
    routers = {}
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls.endswith("TopKRouter") or (cls.endswith("Router") and hasattr(module, "top_k")):
            if cls not in SUPPORTED_ROUTERS:
                raise ValueError(
                    f"routing replay does not know the gate weights of {cls} ({name}); it replays "
                    f"{', '.join(SUPPORTED_ROUTERS)}"
                )
            match = _LAYER_INDEX.search(name)
            if match is None:
                raise ValueError(f"cannot tell the decoder layer of router {name}")
            routers[int(match.group(1))] = module
    return routers


def replayed_weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The gate weights ``router`` gives ``experts`` [tokens, topk] from its ``logits`` [tokens, num_experts]."""
    if type(router).__name__ in SIGMOID_ROUTERS:  # the bias chose the experts; it does not weigh them
        weights = logits.sigmoid().gather(1, experts)
        if router.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return weights * router.routed_scaling_factor
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, experts)
    if router.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def attach_routing_replay(model: nn.Module, replay: RoutingReplay) -> list[int]:
    """Hook every router of ``model`` to ``replay``; returns the MoE layer indices."""
    routers = router_modules(model)
    for layer, router in routers.items():
        replay.register_layer(layer)
        router.register_forward_hook(_hook(replay, layer))
    return sorted(routers)


def _hook(replay: RoutingReplay, layer: int):
    def hook(router: nn.Module, _inputs, output):
        logits, weights, own = output
        chosen = replay.choose(layer, own)
        if chosen is own:
            return output
        return logits, replayed_weights(router, logits, chosen), chosen

    return hook
