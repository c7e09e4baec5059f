"""A rollout on its way to the trainers by reference (DESIGN.md §4): the rollout manager shapes the rewards, splits the
samples over each training group's data-parallel ranks and puts every rank's share in Ray's object store; the
driver holds only the references and the metrics, and each training rank fetches its own share."""

from __future__ import annotations

from dataclasses import dataclass, field

import ray

from vime.utils.flops import sequence_flops
from vime.utils.types import RolloutFnTrainOutput, Sample


@dataclass
class TrainPartition:
    """One data-parallel rank's share of a rollout: its samples and their shaped rewards."""

    samples: list[Sample]
    rewards: list[float]


@dataclass
class RolloutBatch:
    """A rollout as the driver sees it: metrics, and for each data-parallel size asked for, the sample indices of
    every rank and a reference to every rank's :class:`TrainPartition`."""

    metrics: dict
    num_samples: int
    indices: dict[int, list[list[int]]] = field(default_factory=dict)
    partitions: dict[int, list[ray.ObjectRef]] = field(default_factory=dict)


def make_batch(args, output: RolloutFnTrainOutput, dp_sizes: tuple[int, ...]) -> RolloutBatch:
    """Shape the rewards of ``output`` over the whole rollout and put each rank's share for every data-parallel size
    in ``dp_sizes`` into the object store (called where the rollout was made, e.g. in the rollout manager)."""
    num_samples = sum(len(group) for group in output.samples)
    batch = RolloutBatch(metrics=output.metrics or {}, num_samples=num_samples)
    if not dp_sizes:
        return batch
    # here: the driver imports this module (for RolloutBatch) but never makes a batch, and train_data imports torch
    from vime.utils.train_data import split_rollout, train_samples_and_rewards

    samples, rewards = train_samples_and_rewards(args, output.samples)
    lengths = [len(s.tokens) for s in samples]
    if args.balance_data:  # slime: balance the ranks' estimated FLOPs, not only their tokens
        lengths = sequence_flops(lengths, args.hf_checkpoint)
    for dp_size in set(dp_sizes):
        parts = split_rollout(lengths, dp_size, args.global_batch_size)
        batch.indices[dp_size] = parts
        batch.partitions[dp_size] = [
            ray.put(TrainPartition([samples[i] for i in part], [rewards[i] for i in part])) for part in parts
        ]
    return batch


@ray.remote(num_cpus=0)
def _regroup(source: list[list[int]], target: list[list[int]], *parts: list):
    by_sample = {
        i: value
        for indices, part in zip(source, parts, strict=True)
        for i, value in zip(indices, part, strict=True)
    }
    regrouped = [[by_sample[i] for i in indices] for indices in target]
    return regrouped[0] if len(regrouped) == 1 else tuple(regrouped)


def regroup(
    refs: list[ray.ObjectRef], source: list[list[int]], target: list[list[int]]
) -> list[ray.ObjectRef]:
    """Per-sample results held per rank of one partitioning (``refs``, split as ``source``) re-cut for another
    (``target``), in a Ray task: the driver never holds them. The same object references when the two agree."""
    if source == target:
        return refs
    out = _regroup.options(num_returns=len(target)).remote(source, target, *refs)
    return [out] if len(target) == 1 else list(out)
