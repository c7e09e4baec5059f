"""Tests for vime.rollout.filter_hub: each built-in dynamic-sampling filter's keep and drop cases."""

from __future__ import annotations

import types

import pytest

from vime.rollout.filter_hub import DynamicFilterOutput
from vime.rollout.filter_hub.dynamic_sampling_filters import (
    check_no_failed,
    check_not_all_truncated,
    check_reward_mean_in_range,
    check_reward_nonzero_std,
)
from vime.utils.misc import load_function
from vime.utils.types import Sample, Status


def _group(*rewards, statuses=None):
    statuses = statuses or [Status.COMPLETED] * len(rewards)
    return [
        Sample(index=i, reward=r, status=s) for i, (r, s) in enumerate(zip(rewards, statuses, strict=True))
    ]


ARGS = types.SimpleNamespace()


def test_output_defaults():
    assert DynamicFilterOutput(keep=True) == DynamicFilterOutput(True, None)


@pytest.mark.parametrize(
    "rewards, keep",
    [
        ((1.0, 0.0, 1.0), True),
        ((0.5, 0.5 + 1e-3), True),
        ((1.0, 1.0, 1.0), False),
        ((0.0, 0.0), False),
        ((0.1 + 0.2, 0.3), False),  # float noise is not signal
        ((1.0,), False),
        ((), False),
    ],
)
def test_nonzero_std(rewards, keep):
    out = check_reward_nonzero_std(ARGS, _group(*rewards))
    assert out == DynamicFilterOutput(keep=keep, reason=None if keep else "zero_std")


def test_nonzero_std_uses_reward_key_for_dict_rewards():
    group = _group({"acc": 1.0, "len": 0.3}, {"acc": 1.0, "len": 0.7})
    assert not check_reward_nonzero_std(types.SimpleNamespace(reward_key="acc"), group).keep
    assert check_reward_nonzero_std(types.SimpleNamespace(reward_key="len"), group).keep
    with pytest.raises(ValueError, match="reward-key"):
        check_reward_nonzero_std(ARGS, group)


def test_nonzero_std_ignores_failed_samples():
    # The FAILED sample has no reward (generation failed): it must neither crash nor count.
    assert not check_reward_nonzero_std(
        ARGS, _group(1.0, None, statuses=[Status.COMPLETED, Status.FAILED])
    ).keep
    group = _group(1.0, 0.0, None, statuses=[Status.COMPLETED, Status.TRUNCATED, Status.FAILED])
    assert check_reward_nonzero_std(ARGS, group).keep


def test_no_failed():
    assert check_no_failed(ARGS, _group(1.0, 0.0)) == DynamicFilterOutput(keep=True)
    group = _group(1.0, 0.0, statuses=[Status.COMPLETED, Status.FAILED])
    assert check_no_failed(ARGS, group) == DynamicFilterOutput(keep=False, reason="failed")


def test_not_all_truncated():
    some = _group(0.0, 1.0, statuses=[Status.TRUNCATED, Status.COMPLETED])
    assert check_not_all_truncated(ARGS, some) == DynamicFilterOutput(keep=True)
    every = _group(0.0, 1.0, statuses=[Status.TRUNCATED, Status.TRUNCATED])
    assert check_not_all_truncated(ARGS, every) == DynamicFilterOutput(keep=False, reason="all_truncated")


@pytest.mark.parametrize(
    "min_mean, max_mean, rewards, reason",
    [
        (0.1, 0.9, (1.0, 0.0), None),
        (None, None, (1.0, 1.0), None),  # no bounds: keep
        (0.1, 0.9, (0.0, 0.0), "mean_below_min"),
        (0.1, 0.9, (1.0, 1.0), "mean_above_max"),
        (0.5, 0.5, (1.0, 0.0), None),  # bounds are inclusive
        (None, 0.9, (0.0, 0.0), None),
        (0.1, None, (1.0, 1.0), None),
    ],
)
def test_reward_mean_in_range(min_mean, max_mean, rewards, reason):
    args = types.SimpleNamespace(dynamic_sampling_min_mean=min_mean, dynamic_sampling_max_mean=max_mean)
    out = check_reward_mean_in_range(args, _group(*rewards))
    assert out == DynamicFilterOutput(keep=reason is None, reason=reason)


def test_reward_mean_in_range_all_failed_is_dropped():
    group = _group(None, None, statuses=[Status.FAILED, Status.FAILED])
    assert check_reward_mean_in_range(ARGS, group) == DynamicFilterOutput(keep=False, reason="no_reward")


def test_filters_load_by_path():
    fn = load_function(
        "vime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
        "--dynamic-sampling-filter-path",
    )
    assert fn is check_reward_nonzero_std
