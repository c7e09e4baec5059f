"""Routing replay on Megatron-Core MoE routers (``vime.utils.routing_replay``).

Megatron-Core 0.19's ``TopKRouter`` routes through ``topk_routing_with_score_function(..., router_replay=
self.router_replay)``, which asks ``router_replay.get_replay_topk(scores, topk, num_groups, group_topk,
compute_topk)`` for the top-k (its own ``RouterReplay`` class, off unless ``moe_enable_routing_replay``). vime puts
its own object there: it computes the router's choice as usual, asks the :class:`RoutingReplay` which experts to
use, and returns the scores at those experts. ``topk_routing_with_score_function`` then turns them into gate
weights as it always does (softmax over the top-k logits, or the pre-softmax / sigmoid probabilities at the
chosen experts, renormalised and scaled as configured), so the weights come from the trainer's own logits.

Each router sees this rank's tokens: its context-parallel share of the packed row, split again over the
tensor-parallel ranks with sequence parallelism (``PackedLayout.local_rows``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.transformer.moe.router import TopKRouter

from vime.utils.routing_replay import RoutingReplay


class ReplayTopK:
    """What a ``TopKRouter`` holds as ``router_replay``: its top-k, then :meth:`RoutingReplay.choose`."""

    def __init__(self, replay: RoutingReplay, layer: int):
        self.replay, self.layer = replay, layer
        self.layer_number = layer + 1  # Megatron sets this on its own RouterReplay

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        chosen = self.replay.choose(self.layer, own)
        if chosen is own:
            return values, own
        return scores.gather(1, chosen), chosen


def attach_routing_replay(module: torch.nn.Module, replay: RoutingReplay) -> list[int]:
    """Route every ``TopKRouter`` of ``module`` (this pipeline stage's layers) through ``replay``; returns the
    decoder-layer indices (0-based, over the whole model) of its MoE layers."""
    layers = []
    for name, router in module.named_modules():
        if not isinstance(router, TopKRouter):
            continue
        config = router.config
        if config.moe_router_fusion or router.routing_type in ("sinkhorn", "quantile_balancing"):
            raise ValueError(
                f"routing replay needs Megatron's unfused top-k routing; {name} uses "
                f"{'--moe-router-fusion' if config.moe_router_fusion else router.routing_type}"
            )
        if router.layer_number is None:
            raise ValueError(f"{name}: Megatron set no layer number on this router")
        layer = router.layer_number - 1
        replay.register_layer(layer)
        router.router_replay = ReplayTopK(replay, layer)
        layers.append(layer)
    return sorted(layers)
