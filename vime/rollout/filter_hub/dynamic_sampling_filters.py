"""Built-in dynamic-sampling filters, ``fn(args, samples, **kwargs) -> DynamicFilterOutput``.

Pass one as ``--dynamic-sampling-filter-path vime.rollout.filter_hub.dynamic_sampling_filters.<name>``.
Each sees one group (the ``n_samples_per_prompt`` responses to one prompt) after rewards are set.
Rewards are read with ``sample.reward_value(args.reward_key)``; samples whose generation or reward FAILED
are left out of reward statistics (they carry no meaningful reward).
"""

from __future__ import annotations

from typing import Any

from vime.rollout.filter_hub.base_types import DynamicFilterOutput
from vime.utils.types import Sample, Status

__all__ = [
    "check_no_failed",
    "check_not_all_truncated",
    "check_reward_mean_in_range",
    "check_reward_nonzero_std",
]

# Rewards closer than this count as equal, so float noise does not keep a group with no learning signal.
_EQUAL_TOL = 1e-6


def _rewards(args: Any, samples: list[Sample]) -> list[float]:
    reward_key = getattr(args, "reward_key", None)
    return [sample.reward_value(reward_key) for sample in samples if sample.status != Status.FAILED]


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """Keep the group iff its rewards are not all equal (GRPO advantages would all be zero otherwise).

    FAILED samples are ignored; fewer than two rewards left counts as all equal. Drop reason: ``zero_std``.
    """
    rewards = _rewards(args, samples)
    keep = len(rewards) >= 2 and max(rewards) - min(rewards) > _EQUAL_TOL
    return DynamicFilterOutput(keep=keep, reason=None if keep else "zero_std")


def check_no_failed(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """Drop the group if any sample is FAILED (generation or reward). Drop reason: ``failed``."""
    keep = all(sample.status != Status.FAILED for sample in samples)
    return DynamicFilterOutput(keep=keep, reason=None if keep else "failed")


def check_not_all_truncated(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """Drop the group if every sample hit the length limit (TRUNCATED). Drop reason: ``all_truncated``."""
    keep = any(sample.status != Status.TRUNCATED for sample in samples)
    return DynamicFilterOutput(keep=keep, reason=None if keep else "all_truncated")


def check_reward_mean_in_range(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """Keep the group iff its mean reward lies in ``[args.dynamic_sampling_min_mean, ..._max_mean]``.

    A bound that is unset (``None``) does not apply; FAILED samples are ignored, and a group with no reward
    left is dropped as ``no_reward``. Drop reasons: ``mean_below_min`` (too hard), ``mean_above_max``
    (too easy).
    """
    rewards = _rewards(args, samples)
    if not rewards:
        return DynamicFilterOutput(keep=False, reason="no_reward")
    mean = sum(rewards) / len(rewards)
    min_mean = getattr(args, "dynamic_sampling_min_mean", None)
    max_mean = getattr(args, "dynamic_sampling_max_mean", None)
    if min_mean is not None and mean < min_mean:
        return DynamicFilterOutput(keep=False, reason="mean_below_min")
    if max_mean is not None and mean > max_mean:
        return DynamicFilterOutput(keep=False, reason="mean_above_max")
    return DynamicFilterOutput(keep=True)
