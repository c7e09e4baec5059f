"""Routing replay for MoE training, shared by both backends (slime's ``--use-routing-replay`` and
``--use-rollout-routing-replay``).

A :class:`RoutingReplay` sits between a model's MoE routers and the top-k choice each makes. A backend hooks every
router to :meth:`RoutingReplay.choose` (HF routers in ``fsdp_utils.routing_replay``, Megatron-Core's in
``megatron_utils.routing_replay``) and, before each micro-batch's forward, hands that micro-batch's routing to
:meth:`RoutingReplay.push` (:class:`MicroBatchRouting`, packed from per-sample arrays by
``train_data.pack_samples``). Then in

- ``record`` mode each router keeps its own choice (:meth:`RoutingReplay.recorded`);
- ``replay`` mode each router uses the pushed experts for the tokens the micro-batch's mask marks and its own
  choice elsewhere; the gate weights are then computed by the router from its own logits over those experts.

Micro-batches are matched to router calls by order, per layer: the n-th forward call of a layer takes the n-th
pushed micro-batch, and a call made while autograd runs a backward pass (activation recompute) takes the next
micro-batch of that layer's recompute sequence. So pipeline schedules that interleave the forwards and backwards
of several micro-batches, and recompute inside backward, both see the routing of their own micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch


class ReplayMode(StrEnum):
    OFF = "off"
    RECORD = "record"
    REPLAY = "replay"


@dataclass
class MicroBatchRouting:
    """The routing of one packed micro-batch (rows: the micro-batch's tokens in packed order, or the part of them
    this rank holds). ``experts`` [rows, num_layers, topk] integer; ``mask`` [rows] bool: whether a row's experts
    are replayed (False: that token routes on the router's own choice, and its ``experts`` row is ignored)."""

    experts: torch.Tensor
    mask: torch.Tensor

    def to(self, device: torch.device | str) -> MicroBatchRouting:
        return MicroBatchRouting(
            self.experts.to(device, non_blocking=True), self.mask.to(device, non_blocking=True)
        )


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (a forward here is an activation recompute)."""
    return torch._C._current_graph_task_id() != -1


class RoutingReplay:
    """Record or replay the top-k expert choice of one model's MoE layers; see the module docstring.
    ``num_layers`` counts all decoder layers (MoE layers are addressed by their index among them)."""

    def __init__(self, num_layers: int, topk: int):
        self.num_layers, self.topk = num_layers, topk
        self.mode = ReplayMode.OFF
        self.layers: set[int] = set()  # the MoE layers hooked on this rank
        self._batches: list[MicroBatchRouting | None] = []
        self._recorded: list[dict[int, torch.Tensor]] = []
        self._forward: dict[int, int] = {}
        self._recompute: dict[int, int] = {}

    def register_layer(self, layer: int) -> None:
        """Declare that the router of decoder layer ``layer`` calls :meth:`choose`."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"MoE layer {layer} outside the model's {self.num_layers} layers")
        self.layers.add(layer)

    def start(self, mode: ReplayMode) -> None:
        """Begin a pass (a forward-only pass, or one optimizer step's forwards and backwards) in ``mode``."""
        self._reset()
        self.mode = ReplayMode(mode)

    def push(self, routing: MicroBatchRouting | None) -> None:
        """The routing of the next micro-batch the model runs (None: no token of it is replayed)."""
        self._batches.append(routing)
        self._recorded.append({})

    def choose(self, layer: int, own: torch.Tensor) -> torch.Tensor:
        """The experts router ``layer`` uses for its tokens, given its own top-k choice ``own`` [tokens, topk]."""
        if self.mode is ReplayMode.OFF:
            return own
        counters = self._recompute if in_backward() else self._forward
        index = counters.get(layer, 0)
        counters[layer] = index + 1
        if index >= len(self._batches):
            raise RuntimeError(
                f"MoE layer {layer} ran {index + 1} forwards but {len(self._batches)} micro-batches were pushed "
                "for routing replay; push each micro-batch's routing before its forward"
            )
        if self.mode is ReplayMode.RECORD:
            if counters is self._forward:
                self._recorded[index][layer] = own.detach().to(torch.int32)
            return own
        routing = self._batches[index]
        if routing is None:
            return own
        if routing.experts.shape[0] != own.shape[0] or own.shape[1] != self.topk:
            raise ValueError(
                f"MoE layer {layer}: the router sees {own.shape[0]} tokens x top-{own.shape[1]} but the replayed "
                f"micro-batch has {routing.experts.shape[0]} tokens x top-{self.topk}"
            )
        target = routing.experts[:, layer].to(device=own.device, dtype=own.dtype)
        return torch.where(routing.mask.to(own.device).unsqueeze(1), target, own)

    def recorded(self) -> list[torch.Tensor]:
        """Per pushed micro-batch (record mode): ``[tokens, num_layers, topk]`` int32 experts chosen by each hooked
        layer (other layers' entries are 0)."""
        out = []
        for index, per_layer in enumerate(self._recorded):
            if not per_layer:
                raise RuntimeError(f"no MoE layer ran for recorded micro-batch {index}")
            first = next(iter(per_layer.values()))
            experts = first.new_zeros((first.shape[0], self.num_layers, self.topk))
            for layer, chosen in per_layer.items():
                experts[:, layer] = chosen
            out.append(experts)
        return out

    def stop(self, check: bool = True) -> None:
        """End the pass and go back to ``off``; with ``check``, every hooked layer must have run once per pushed
        micro-batch."""
        try:
            if check and self.mode is not ReplayMode.OFF and self._batches:
                missed = {
                    layer: self._forward.get(layer, 0)
                    for layer in sorted(self.layers)
                    if self._forward.get(layer, 0) != len(self._batches)
                }
                if missed:
                    raise RuntimeError(
                        f"routing replay: {len(self._batches)} micro-batches were pushed but MoE layers ran "
                        f"{missed} forwards (layer: count)"
                    )
        finally:
            self._reset()
            self.mode = ReplayMode.OFF

    def _reset(self) -> None:
        self._batches, self._recorded = [], []
        self._forward, self._recompute = {}, {}
