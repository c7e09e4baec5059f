"""How one training rank's samples become micro-batches and the loss's inputs: the token budget, the plan (fixed
size, packed to the budget, or balanced by FLOPs; the same count on every data-parallel rank), and per micro-batch
the packed tokens, the per-sample tensors and the reducer normalised over the global batch (slime's trajectories
included)."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

import torch

from vime.backends.policy_inputs import PerSample
from vime.utils.distributed import DataParallel
from vime.utils.flops import sequence_flops
from vime.utils.loss import make_reducer
from vime.utils.train_data import (
    PackedBatch,
    balanced_partitions,
    dynamic_micro_batches,
    fixed_micro_batches,
    min_micro_batches,
    pack_samples,
)
from vime.utils.types import Sample


def trajectory_key(sample: Sample) -> tuple[str, int | None]:
    """The trajectory a sample belongs to: its ``rollout_id`` when a plug-in set one (slime's meaning), else itself."""
    return ("trajectory", sample.rollout_id) if sample.rollout_id is not None else ("sample", sample.index)


def token_budget(args: argparse.Namespace, cp_size: int, forward_only: bool = False) -> int | None:
    """Tokens a packed micro-batch may hold: ``--max-tokens-per-gpu`` (``--log-probs-max-tokens-per-gpu`` for
    forward-only passes: one GPU holds the whole row), times the context-parallel ranks that share the row."""
    budget = (
        (args.log_probs_max_tokens_per_gpu or args.max_tokens_per_gpu)
        if forward_only
        else args.max_tokens_per_gpu
    )
    return budget * cp_size if budget else budget


def plan(
    args: argparse.Namespace, samples: list[Sample], budget: int | None, dp: DataParallel
) -> list[list[int]]:
    """Sample indices of each micro-batch (``--micro-batch-size``, or packed up to ``--max-tokens-per-gpu``
    with ``--use-dynamic-batch-size``; by estimated FLOPs with ``--balance-by-flops``). Every data-parallel
    rank gets the same number of micro-batches (collectives run per forward/backward), so ranks must hold
    equally many samples."""
    lengths = [len(s.tokens) for s in samples]
    needed = 0
    if args.use_dynamic_batch_size:
        needed = (
            min(len(samples), -(-sum(lengths) // budget))  # slime: the tokens' share of the budget
            if args.balance_by_flops
            else min_micro_batches(lengths, budget)
        )
    most, minus_fewest, num_micro_batches = (int(n) for n in dp.max([len(samples), -len(samples), needed]))
    if most != -minus_fewest:
        raise ValueError(
            f"data-parallel ranks hold between {-minus_fewest} and {most} samples; split rollouts with "
            "vime.utils.train_data.split_rollout so every rank gets the same number"
        )
    if args.use_dynamic_batch_size and args.balance_by_flops:  # may exceed the token budget (slime)
        flops = sequence_flops(lengths, args.hf_checkpoint)
        return sorted(balanced_partitions(flops, max(num_micro_batches, 1), equal_size=False))
    if args.use_dynamic_batch_size:
        return dynamic_micro_batches(lengths, budget, num_micro_batches)
    return fixed_micro_batches(len(samples), args.micro_batch_size)


def loss_inputs(
    args: argparse.Namespace,
    samples: list[Sample],
    masks: PerSample,
    data: dict[str, PerSample | None],
    micro_batches: list[list[int]],
    routes: list | None,
    dp: DataParallel,
    device: torch.device,
    with_tokens: bool = False,
) -> tuple[list[tuple[list[int], PackedBatch, dict[str, Any]]], float]:
    """For one optimizer step: each micro-batch's sample indices, packed tokens (with the experts to replay, under
    routing replay) and loss inputs (``batch`` of :func:`~vime.utils.loss.policy_loss`, with a ``reduce``
    normalised by the global sample and token counts), and the step's total token count over all data-parallel
    ranks. ``micro_batches``: from :func:`plan`; ``routes``: each sample's experts to replay (routing replay);
    ``with_tokens``: the batch holds each sample's tokens too (``unconcat_tokens``, for slime's custom losses)."""
    num_samples, num_tokens, total_tokens, in_trajectories = dp.sum(
        [
            len(samples),
            float(sum(m.sum() for m in masks)),
            sum(len(s.tokens) for s in samples),
            sum(s.rollout_id is not None for s in samples),
        ]
    )
    denominators = None
    if in_trajectories:
        num_samples, denominators = trajectory_denominators(samples, masks, dp)
    inputs = []
    for mb in micro_batches:
        packed = pack_samples([samples[i] for i in mb], [routes[i] for i in mb] if routes else None)
        mask = torch.cat([masks[i] for i in mb]).to(device, non_blocking=True)
        batch: dict[str, Any] = {
            "response_lengths": packed.response_lengths,
            "total_lengths": packed.total_lengths,
            "loss_mask": mask,
            "reduce": make_reducer(
                mask,
                packed.response_lengths,
                args.calculate_per_token_loss,
                int(num_samples),
                int(num_tokens),
                None
                if denominators is None
                else torch.tensor([denominators[i] for i in mb]).to(device, non_blocking=True),
            ),
        }
        for key, per_sample in data.items():
            batch[key] = (
                torch.cat([per_sample[i] for i in mb]).to(device, non_blocking=True)
                if per_sample is not None
                else None
            )
        if with_tokens:
            batch["unconcat_tokens"] = [torch.tensor(samples[i].tokens) for i in mb]
        inputs.append((mb, packed, batch))
    return inputs, total_tokens


def trajectory_denominators(
    samples: list[Sample], masks: PerSample, dp: DataParallel
) -> tuple[int, list[float]]:
    """slime's loss over trajectories: the samples sharing a ``rollout_id`` (one trajectory split into several
    samples, e.g. the turns or agents of one episode) form one token-weighted mean, and the optimizer step
    averages over trajectories. Returns the number of trajectories in the step over all data-parallel ranks and
    each sample's denominator: its trajectory's loss-masked tokens (a sample without ``rollout_id`` is its own
    trajectory)."""
    local: Counter = Counter()
    for sample, mask in zip(samples, masks, strict=True):
        local[trajectory_key(sample)] += float(mask.sum())
    totals: Counter = Counter()
    for part in dp.gather_objects(local):
        totals.update(part)
    return len(totals), [totals[trajectory_key(s)] for s in samples]


def add_metrics(sums: dict[str, torch.Tensor | float], metrics: dict[str, Any]) -> None:
    """Add one micro-batch's loss metrics into ``sums``. Tensors stay on their device (a ``float()`` per metric
    and micro-batch made the host wait for the GPU between every forward and backward); :func:`metric_sums`
    reads them once, after the step."""
    for key, value in metrics.items():
        value = value.detach() if isinstance(value, torch.Tensor) else float(value)
        sums[key] = sums.get(key, 0.0) + value


def metric_sums(sums: dict[str, torch.Tensor | float], dp: DataParallel) -> dict[str, float]:
    """``sums`` as floats, summed over the data-parallel ranks."""
    keys = sorted(sums)
    return dict(zip(keys, dp.sum([float(sums[k]) for k in keys]), strict=True))
