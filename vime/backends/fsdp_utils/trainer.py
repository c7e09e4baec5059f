"""``FSDPTrainer``: the torch-native training backend, one instance per training rank (DESIGN.md §1).

The Ray layer drives it; every public method is collective (all ranks call it, each with its own data).
PPO wiring, with the critic and the actor holding the same per-rank partition::

    values = critic.compute_values(samples)
    critic.train(rollout_id, samples, rewards, values=values)   # + log_probs/ref_log_probs from the actor when --kl-coef
    actor.train(rollout_id, samples, rewards, values=values)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from vime.backends.fsdp_utils import checkpoint, weights
from vime.backends.fsdp_utils.log_probs import (
    forward_log_probs,
    forward_values,
    response_logits,
    token_log_probs,
)
from vime.backends.fsdp_utils.model import ROLES, build_model, compute_dtype
from vime.backends.fsdp_utils.optimizer import build_lr_scheduler, build_optimizer
from vime.backends.fsdp_utils.routing_replay import attach_routing_replay
from vime.backends.micro_batches import add_metrics, metric_sums
from vime.backends.trainer_base import PerSample, TrainerBase
from vime.utils.distributed import DataParallel, device, init_distributed
from vime.utils.freeze import apply_trainable_patterns
from vime.utils.loss import slime_loss_batch, value_loss
from vime.utils.memory_plan import local_bytes
from vime.utils.offload import optimizer_tensors
from vime.utils.ppo_utils import head_log_probs_from_logits
from vime.utils.routing_replay import ReplayMode
from vime.utils.train_data import pack_samples, split_routing
from vime.utils.types import Sample
from vime.utils.weight_buckets import Bucket


class FSDPTrainer(TrainerBase):
    """Policy (``role="actor"``, with a frozen reference model when ``--use-kl-loss`` or ``--kl-coef`` and a frozen
    teacher with ``--opd-kl-coef``) or value model (``role="critic"``, lr ``--critic-lr``) on FSDP2.

    Hooks: ``--custom-loss-function-path`` has the signature of :func:`~vime.utils.loss.policy_loss`
    (``fn(args, batch, log_probs, entropy) -> (loss, metrics)``); ``--custom-advantage-function-path`` is
    ``fn(args, samples, rewards, log_probs, ref_log_probs, values) -> list[Tensor]``: per-sample advantages over
    the response tokens, from the shaped rewards, old log-probs and (or None) reference log-probs and critic
    values; the critic's returns are then ``advantages + values``.
    """

    def __init__(self, args: argparse.Namespace, role: str = "actor"):
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        init_distributed(args.distributed_timeout_minutes, args.distributed_backend)
        self.args, self.role = args, role
        self.dp = DataParallel(dist.get_rank(), dist.get_world_size())  # every rank holds its own samples
        self.device = device()
        self._start_memory_recording()
        self.mesh = init_device_mesh(self.device.type, (self.dp.size,))
        self._seed()
        self.model = self.module = build_model(args.hf_checkpoint, role, self.mesh, args)
        apply_trainable_patterns(self.model, args.freeze_params_name_list, args.only_train_params_name_list)
        self.optimizer = build_optimizer(args, self.model, self.learning_rate)
        self.scheduler = build_lr_scheduler(args, self.optimizer, self.learning_rate)
        self.step = 0  # optimizer steps taken
        self._init_policy_models_and_hooks(self._frozen_model, is_actor=role == "actor")
        config = self.model.config
        num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        self._init_routing_replay(
            config.num_hidden_layers,
            getattr(config, "num_experts_per_tok", 0),
            num_experts,
            attach_routing_replay,
        )
        self.memory_plan = self.check_memory_plan()

    def _frozen_model(self, path: str, step: int | None = None) -> nn.Module:
        is_checkpoint = step is not None or checkpoint.latest_iteration(path) is not None
        model = build_model(
            self.args.hf_checkpoint if is_checkpoint else path, "actor", self.mesh, self.args, False
        )
        if is_checkpoint:
            checkpoint.load_weights(model, path, step)
        return model

    # ------------------------------------------------------------------------------------------ checkpoints
    def _load_checkpoint(self, load_dir: str, step: int, optimizer: Any | None, load_rng: bool) -> dict:
        iter_dir = checkpoint.iteration_dir(load_dir, step)
        return checkpoint.load_checkpoint(iter_dir, self.model, optimizer, self.scheduler, load_rng)

    def _load_weights(self, path: str, step: int | None) -> None:
        checkpoint.load_weights(self.model, path, step)

    def _save_checkpoint(self, save_dir: str, rollout_id: int, optimizer: Any | None) -> None:
        checkpoint.save_checkpoint(save_dir, rollout_id, self.model, optimizer, self.scheduler, self.step)

    def export_hf(self, out_dir: str) -> None:
        checkpoint.export_hf(self.model, out_dir, self.args.hf_checkpoint, compute_dtype(self.args))

    def _gpu_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        models = [
            m for m in (self.model, self.ref_model, self.teacher_model, self.old_actor_model) if m is not None
        ]
        params = [p for m in models for p in m.parameters()]
        return params + optimizer_tensors(self.optimizer), [p.grad for p in params]

    def iter_weight_buckets(self, buffer_bytes: int, stack_experts: bool = False) -> Iterator[Bucket]:
        return weights.iter_weight_buckets(self.model, buffer_bytes, compute_dtype(self.args), stack_experts)

    # ------------------------------------------------------------------------------------------- forward only
    def _forward(
        self, net: nn.Module, samples: list[Sample], model: str, with_entropy: bool = False
    ) -> tuple[PerSample, PerSample | None]:
        """Per-sample outputs of ``net`` (``model``: "actor", "ref", "teacher", "old_actor" or "critic") and, with
        ``with_entropy``, the entropies, micro-batch by micro-batch, its MoE routers replaying or recording as the
        routing plan says."""
        out: PerSample = [torch.empty(0)] * len(samples)
        entropies: PerSample = [torch.empty(0)] * len(samples)
        mode, routes = self._pass_routing(model, samples)
        micro_batches = self._micro_batches(samples, forward_only=True)
        with torch.no_grad(), self._routing_pass(mode) as replay:
            packs = []
            for mb in micro_batches:
                packed = pack_samples([samples[i] for i in mb], [routes[i] for i in mb] if routes else None)
                packs.append(packed)
                if replay is not None:
                    replay.push(packed.routing.to(self.device) if packed.routing else None)
                entropy = None
                if self.role == "critic":
                    flat = forward_values(net, packed, self.device)
                else:
                    flat, entropy = forward_log_probs(
                        net, packed, self.args.rollout_temperature, self.device, with_entropy,
                        chunk_size=self.args.log_probs_chunk_size,
                    )  # fmt: skip
                for i, piece in zip(mb, flat.split(packed.response_lengths), strict=True):
                    out[i] = piece.cpu()
                if entropy is not None:
                    for i, piece in zip(mb, entropy.split(packed.response_lengths), strict=True):
                        entropies[i] = piece.cpu()
            if mode is ReplayMode.RECORD:
                for mb, packed, experts in zip(micro_batches, packs, replay.recorded(), strict=True):
                    self.routing.store([samples[i] for i in mb], split_routing(experts, packed.total_lengths))
        return out, (entropies if with_entropy and self.role != "critic" else None)

    # ------------------------------------------------------------------------------------------------ train
    def _gradients_to_come(self) -> list[torch.Tensor]:
        """Trainable parameters with no gradient yet: FSDP2 creates them in the first backward of a step."""
        return [p for p in self.model.parameters() if p.requires_grad and p.grad is None]

    def _probe_gradient_bytes(self) -> int:
        return sum(local_bytes(p) for p in self._gradients_to_come())

    def _memory_probe(self, samples: list[Sample]) -> None:
        # as in a step's later micro-batches, the gradients are resident before the forward (without them the
        # probes predicted the 4B-shaped step's peak 16 GiB low: the first backward creates them as it frees
        # activations)
        for param in self._gradients_to_come():
            param.grad = torch.zeros_like(param)
        packed = pack_samples(samples)
        if self.role == "critic":
            loss = forward_values(self.model, packed, self.device).sum()
        else:
            entropy_grad = self._entropy_needs_grad()
            log_probs, entropy = forward_log_probs(
                self.model, packed, self.args.rollout_temperature, self.device, True, entropy_grad,
                self.args.log_probs_chunk_size,
            )  # fmt: skip
            loss = log_probs.sum() + (entropy.sum() if entropy_grad else 0.0)
        (loss * 0.0).backward()
        self.optimizer.zero_grad(set_to_none=True)

    def _loss_from_logits(self, batch: dict, logits: torch.Tensor, labels: torch.Tensor) -> tuple:
        """The policy loss of one micro-batch from its response logits; with ``--recompute-loss-function`` its
        ``[tokens, vocab]`` intermediates are recomputed in backward instead of kept (only the logits are)."""
        args = self.args
        entropy_grad = self._entropy_needs_grad()

        def loss_of(logits: torch.Tensor) -> tuple:
            if self.loss_takes_logits:  # slime's signature: the response rows' logits and the reducer
                return self.loss_fn(args, slime_loss_batch(batch), logits, batch["reduce"])
            log_probs, entropy = token_log_probs(
                logits, labels, args.rollout_temperature, True, entropy_grad, args.log_probs_chunk_size
            )
            if args.use_score_centering:  # the trainer's log-probs at the sampler's head tokens
                head = head_log_probs_from_logits(
                    logits, batch["rollout_topk_token_ids"], labels, log_probs, args.rollout_temperature
                )
                return self.loss_fn(args, batch | {"train_topk_log_probs": head}, log_probs, entropy)
            return self.loss_fn(args, batch, log_probs, entropy)

        if args.recompute_loss_function:
            return torch.utils.checkpoint.checkpoint(loss_of, logits, use_reentrant=False)
        return loss_of(logits)

    def _train_step(
        self, samples: list[Sample], masks: PerSample, data: dict[str, PerSample | None]
    ) -> dict[str, float]:
        """One optimizer step with gradient accumulation over micro-batches."""
        args = self.args
        start = time.perf_counter()
        sums: dict[str, torch.Tensor | float] = {}
        inputs, total_tokens = self._micro_batch_inputs(samples, masks, data, self.device)
        with self._routing_pass(ReplayMode.REPLAY if self.routing else ReplayMode.OFF) as replay:
            for _, packed, batch in inputs:
                if replay is not None:
                    replay.push(packed.routing.to(self.device) if packed.routing else None)
                if self.role == "critic":
                    loss, metrics = value_loss(args, batch, forward_values(self.model, packed, self.device))
                else:
                    logits, labels = response_logits(self.model, packed, self.device)
                    loss, metrics = self._loss_from_logits(batch, logits, labels)
                # Each rank's loss is already its share of the global loss; FSDP averages gradients over ranks,
                # so scale by the number of ranks to make that average the sum.
                (loss * self.dp.size).backward()
                add_metrics(sums, metrics)
        max_norm = args.clip_grad if args.clip_grad > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        metrics = metric_sums(sums, self.dp)
        elapsed = time.perf_counter() - start
        metrics.update(
            grad_norm=float(grad_norm), lr=lr, step_time_s=elapsed, tokens_per_s=total_tokens / elapsed
        )
        return metrics
