"""Which experts each forward of the actor uses in one training step, for slime's routing-replay flags.

- ``--use-routing-replay``: the old-log-prob pass records every MoE router's top-k choice per token; the
  training forwards and backwards of the step replay exactly those (the reference model routes on its own).
- ``--use-rollout-routing-replay`` (R3, implies the flag above): every actor forward of the step (old
  log-probs, the reference model's, training) replays the experts the rollout engine used, which the samples
  carry as ``Sample.rollout_routed_experts``. slime routes the reference model on its own even then; vime replays
  it too, so that the KL term compares the two models on the same experts. The teacher (``--opd-kl-coef``), a
  model of its own, always routes on its own.

Replayed experts cover every token the engine ran (prompt and response, as slime replays them); a sample's last
token, which the engine never fed back, routes on the trainer's choice (its output predicts nothing). Gate weights
always come from the trainer's own router logits.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from vime.utils.routing_replay import ReplayMode, RoutingReplay
from vime.utils.train_data import is_trainable
from vime.utils.types import Sample

Routes = list[np.ndarray | torch.Tensor | None]


def _key(sample: Sample) -> tuple[int, int]:
    # by content: the same rollout partition reaches the trainer once per Ray call, as new Sample objects
    return len(sample.tokens), hash(tuple(sample.tokens))


class RoutingPlan:
    """The routing of the actor's passes; ``replay`` is the :class:`RoutingReplay` its routers are hooked to."""

    def __init__(self, args: argparse.Namespace, num_layers: int, topk: int, num_experts: int):
        self.args = args
        self.num_layers, self.topk, self.num_experts = num_layers, topk, num_experts
        self.replay = RoutingReplay(num_layers, topk)
        self._recorded: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def rollout(self) -> bool:
        return bool(self.args.use_rollout_routing_replay)

    def for_pass(self, model: str, samples: list[Sample]) -> tuple[ReplayMode, Routes | None]:
        """The mode of a forward-only pass of ``model`` ("actor", "ref" or "teacher") over ``samples``, and the
        per-sample routes to replay."""
        if model == "teacher" or (model == "ref" and not self.rollout) or not self.replay.layers:
            return ReplayMode.OFF, None  # (a pipeline stage may hold no MoE layer)
        if self.rollout:
            return ReplayMode.REPLAY, [self.rollout_route(s) for s in samples]
        self._recorded.clear()  # a new step's old-log-prob pass
        return ReplayMode.RECORD, None

    def for_training(self, samples: list[Sample]) -> Routes | None:
        """The per-sample routes the training forwards/backwards replay (None: no MoE layer on this rank)."""
        if not self.replay.layers:
            return None
        if self.rollout:
            return [self.rollout_route(s) for s in samples]
        missing = [s.index for s in samples if _key(s) not in self._recorded]
        if missing:
            raise RuntimeError(
                f"--use-routing-replay: no routing was recorded for samples {missing[:8]}; it is recorded when the "
                "actor computes the old log-probs of the same samples in this step"
            )
        return [self._recorded[_key(s)] for s in samples]

    def store(self, samples: list[Sample], routes: list[torch.Tensor]) -> None:
        """Keep the routing a record pass saw for each sample (``[len(tokens), layers, topk]``)."""
        for sample, route in zip(samples, routes, strict=True):
            self._recorded[_key(sample)] = route.to(torch.int16 if self.num_experts > 255 else torch.uint8)

    def clear(self) -> None:
        """Forget the step's recorded routing."""
        self._recorded.clear()

    def rollout_route(self, sample: Sample) -> np.ndarray | None:
        """``sample.rollout_routed_experts``, checked against the model; None for a sample that does not train
        and has none (it routes on the trainer's choice)."""
        route = sample.rollout_routed_experts
        where = f"--use-rollout-routing-replay: sample {sample.index}"
        if route is None:
            if not is_trainable(sample):
                return None
            raise ValueError(
                f"{where} has no rollout_routed_experts: its engine must run with --enable-return-routed-experts "
                "(vime starts engines so with this flag); a custom generate function must keep each completion "
                "choice's routed experts (vime.backends.vllm_utils.routed_experts.apply_choice_routing)"
            )
        route = np.asarray(route)
        expected = (self.num_layers, self.topk)
        if route.ndim != 3 or tuple(route.shape[1:]) != expected or len(route) > len(sample.tokens):
            raise ValueError(
                f"{where}: routed experts of shape {route.shape}, expected [<= {len(sample.tokens)} tokens, "
                f"{expected[0]} layers, top-{expected[1]}] (the model's config); was it generated by another model?"
            )
        if route.size and int(route.max()) >= self.num_experts:
            raise ValueError(
                f"{where}: expert id {int(route.max())} >= the model's {self.num_experts} experts"
            )
        if is_trainable(sample) and sample.response_length:
            mask = sample.loss_mask or [1] * sample.response_length
            trained = [i for i, m in enumerate(mask) if m]
            # response token i is predicted at position prompt_length + i - 1, which must have replayed experts
            if trained and sample.prompt_length + trained[-1] - 1 >= len(route):
                raise ValueError(
                    f"{where}: routed experts cover {len(route)} of its {len(sample.tokens)} tokens, not every "
                    "position that predicts a trained response token"
                )
        return route


def make_routing_plan(
    args: argparse.Namespace,
    role: str,
    models: tuple[Any, Any | None],
    num_layers: int,
    topk: int,
    num_experts: int | None,
    attach: Callable[[Any, RoutingReplay], Any],
) -> RoutingPlan | None:
    """The actor's plan (None for the critic, as in slime, or without the flags): the routers of the policy and,
    with R3, of the reference model (``models``) hooked with ``attach(module, replay)``. The model has
    ``num_layers`` decoder layers; its MoE ones route each token to ``topk`` of ``num_experts`` experts."""
    if role != "actor" or not args.use_routing_replay:
        return None
    if not num_experts:
        flag = "--use-rollout-routing-replay" if args.use_rollout_routing_replay else "--use-routing-replay"
        raise ValueError(
            f"{flag} replays the experts a Mixture-of-Experts model's routers choose, but {args.hf_checkpoint} is "
            "a dense model (its config has no experts); drop the flag"
        )
    plan = RoutingPlan(args, num_layers, topk, num_experts)
    policy, reference = models
    attach(policy, plan.replay)
    if reference is not None and args.use_rollout_routing_replay:
        attach(reference, plan.replay)
    return plan


@contextmanager
def routing_pass(plan: RoutingPlan | None, mode: ReplayMode) -> Iterator[RoutingReplay | None]:
    """The routers record or replay in ``mode`` inside the block (one pass over micro-batches, which the block
    pushes in the order the model runs them); yields the :class:`RoutingReplay`, or None to route freely."""
    if plan is None or mode is ReplayMode.OFF:
        yield None
        return
    replay = plan.replay
    replay.start(mode)
    try:
        yield replay
    except BaseException:
        replay.stop(check=False)
        raise
    replay.stop()
