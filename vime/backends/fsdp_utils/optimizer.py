"""Optimizer and learning-rate schedule from the Megatron-named flags (``--optimizer --lr --min-lr
--lr-decay-style --lr-warmup-* --lr-decay-iters --weight-decay --adam-*``), with Megatron's semantics."""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn


def build_optimizer(args: argparse.Namespace, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW (``--optimizer adam``) or SGD at peak ``lr``. As in Megatron, 1-D parameters (norm weights,
    biases) get no weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if args.optimizer == "adam":
        return torch.optim.AdamW(groups, lr=lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
    if args.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    raise ValueError(f"--optimizer {args.optimizer!r} is not supported by the fsdp backend; use adam or sgd")


def lr_at(args: argparse.Namespace, step: int, peak_lr: float, total_steps: int | None) -> float:
    """The learning rate for optimizer step ``step`` (0-based), Megatron's ``OptimizerParamScheduler`` rule.

    Linear warm-up from ``--lr-warmup-init`` over ``--lr-warmup-iters`` (or ``--lr-warmup-fraction`` of the decay
    steps), then ``--lr-decay-style`` from ``peak_lr`` down to ``--min-lr`` over ``--lr-decay-iters`` (default:
    ``total_steps``, all the run's optimizer steps); ``--min-lr`` after that.
    """
    decay_steps = args.lr_decay_iters or total_steps
    if decay_steps is None and (args.lr_decay_style != "constant" or args.lr_warmup_fraction):
        raise ValueError(
            f"--lr-decay-style {args.lr_decay_style} needs the number of decay steps: set --lr-decay-iters "
            "(or --num-rollout, from which it defaults to all optimizer steps)"
        )
    warmup = args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        warmup = int(args.lr_warmup_fraction * decay_steps)
    if warmup > 0 and step <= warmup:
        return args.lr_warmup_init + (peak_lr - args.lr_warmup_init) * step / warmup
    if args.lr_decay_style == "constant":
        return peak_lr
    if args.lr_decay_style == "inverse-square-root":
        return max(args.min_lr, peak_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(step, 1)))
    if step > decay_steps:
        return args.min_lr
    ratio = (step - warmup) / max(decay_steps - warmup, 1)
    if args.lr_decay_style == "linear":
        coeff = 1.0 - ratio
    elif args.lr_decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"unknown --lr-decay-style {args.lr_decay_style!r}")
    return args.min_lr + coeff * (peak_lr - args.min_lr)


def build_lr_scheduler(
    args: argparse.Namespace, optimizer: torch.optim.Optimizer, peak_lr: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following :func:`lr_at`; stepped once per optimizer step (its state is checkpointed)."""
    # --num-epoch's count is known to the rollout manager only, once the prompts are loaded: no total then
    total = args.num_rollout * args.num_steps_per_rollout if args.num_rollout else None
    lr_at(args, 0, peak_lr, total)  # fail at start-up, not at the first step, on a bad schedule

    def factor(step: int) -> float:
        return lr_at(args, step, peak_lr, total) / peak_lr if peak_lr > 0 else 0.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
