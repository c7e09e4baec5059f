"""A rollout travels to the trainers by reference: per data-parallel rank shares with shaped rewards, and per-sample
results re-cut between groups of different data-parallel sizes (real local Ray)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import ray

from vime.ray.rollout_batch import make_batch, regroup
from vime.utils.types import RolloutFnTrainOutput, Sample, Status


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _output() -> RolloutFnTrainOutput:
    groups = [
        [Sample(index=2 * g + i, tokens=[1] * (3 + 2 * g + i), response_length=1, reward=float(i),
                status=Status.COMPLETED) for i in range(2)]
        for g in range(2)
    ]  # fmt: skip
    return RolloutFnTrainOutput(samples=groups, metrics={"rollout/reward_mean": 0.5})


def _args():
    return argparse.Namespace(
        advantage_estimator="grpo",
        grpo_std_normalization=True,
        rewards_normalization=True,
        reward_key=None,
        global_batch_size=4,
        balance_data=False,
    )


def test_each_rank_gets_its_share_with_group_shaped_rewards():
    batch = make_batch(_args(), _output(), dp_sizes=(1, 2))
    assert batch.metrics == {"rollout/reward_mean": 0.5} and batch.num_samples == 4
    whole = ray.get(batch.partitions[1][0])
    assert [s.index for s in whole.samples] == [0, 1, 2, 3]
    assert whole.rewards == pytest.approx([-0.707107, 0.707107] * 2, abs=1e-5)  # (r - mean) / (std + 1e-6)
    halves = [ray.get(ref) for ref in batch.partitions[2]]
    assert sorted(s.index for h in halves for s in h.samples) == [0, 1, 2, 3]
    for half, indices in zip(halves, batch.indices[2], strict=True):
        assert [s.index for s in half.samples] == indices
        assert half.rewards == [whole.rewards[i] for i in indices]


def test_regroup_recuts_per_sample_results_without_the_driver():
    batch = make_batch(_args(), _output(), dp_sizes=(1, 2))
    per_rank = [ray.put([f"v{i}" for i in indices]) for indices in batch.indices[2]]
    (whole,) = regroup(per_rank, batch.indices[2], batch.indices[1])
    assert ray.get(whole) == ["v0", "v1", "v2", "v3"]
    back = regroup([whole], batch.indices[1], batch.indices[2])
    assert [ray.get(r) for r in back] == [[f"v{i}" for i in idx] for idx in batch.indices[2]]
    assert regroup(per_rank, batch.indices[2], batch.indices[2]) is per_rank


def test_no_training_groups_no_partitions():
    batch = make_batch(_args(), _output(), dp_sizes=())
    assert batch.partitions == {} and batch.num_samples == 4


def test_routed_experts_reach_every_rank_with_their_samples():
    output = _output()
    for sample in (s for group in output.samples for s in group):
        sample.rollout_routed_experts = np.full((len(sample.tokens) - 1, 2, 2), sample.index, np.uint8)
    batch = make_batch(_args(), output, dp_sizes=(2,))
    for ref in batch.partitions[2]:
        for sample in ray.get(ref).samples:
            routing = sample.rollout_routed_experts
            assert routing.dtype == np.uint8 and routing.shape == (len(sample.tokens) - 1, 2, 2)
            assert (routing == sample.index).all()
