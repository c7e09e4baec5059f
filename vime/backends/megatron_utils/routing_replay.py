"""Routing replay on Megatron-Core MoE routers (``vime.utils.routing_replay``).

Megatron-Core 0.19's ``TopKRouter`` routes through ``topk_routing_with_score_function(..., router_replay=
self.router_replay)``, which asks ``router_replay.get_replay_topk(scores, topk, num_groups, group_topk,
compute_topk)`` for the top-k (its own ``RouterReplay`` class, off unless ``moe_enable_routing_replay``). vime puts
its own object there: it computes the router's choice as usual, asks the :class:`RoutingReplay` which experts to
use, and returns the scores at those experts. ``topk_routing_with_score_function`` then turns them into gate
weights as it always does (softmax over the top-k logits, or the pre-softmax / sigmoid probabilities at the
chosen experts, renormalised and scaled as configured), so the weights come from the trainer's own logits.

Each router sees this rank's tokens: its context-parallel share of the packed row, split again over the
tensor-parallel ranks with sequence parallelism (:func:`local_routing`; recordings go back with
:func:`full_row_routing`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter

from vime.backends.megatron_utils.packed_layout import PackedLayout
from vime.utils.routing_replay import MicroBatchRouting, RoutingReplay


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


def _sequence_parallel_size(sequence_parallel: bool) -> int:
    """TP ranks that split the sequence between layers (each router sees its slice): TP with SP, else 1."""
    return parallel_state.get_tensor_model_parallel_world_size() if sequence_parallel else 1


def local_routing(
    layout: PackedLayout, routing: MicroBatchRouting | None, sequence_parallel: bool
) -> MicroBatchRouting | None:
    """A packed micro-batch's experts to replay -> the rows this rank's routers see (CP share, SP slice), on the
    GPU."""
    if routing is None:
        return None
    tp, tp_rank = _sequence_parallel_size(sequence_parallel), parallel_state.get_tensor_model_parallel_rank()
    return MicroBatchRouting(
        layout.local_rows(routing.experts, tp, tp_rank).cuda(non_blocking=True),
        layout.local_rows(routing.mask, tp, tp_rank).cuda(non_blocking=True),
    )


def full_row_routing(layout: PackedLayout, local: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """Inverse of :func:`local_routing` for experts recorded on this rank's rows: gathered over the SP slices and the
    CP ranks -> the micro-batch's packed row [tokens, layers, topk] (collective over TP and CP)."""
    groups = []
    if _sequence_parallel_size(sequence_parallel) > 1:
        groups.append(parallel_state.get_tensor_model_parallel_group())
    if parallel_state.get_context_parallel_world_size() > 1:
        groups.append(parallel_state.get_context_parallel_group())
    for group in groups:  # SP slices first: together they are one CP rank's rows
        gathered = local.new_empty((dist.get_world_size(group) * len(local), *local.shape[1:]))
        dist.all_gather_into_tensor(gathered, local.contiguous(), group=group)
        local = gathered
    return layout.from_local_rows(local)
