"""Eval metrics from groups of scored samples: mean reward, pass@k, truncation, failures, response length.

A sample *passes* when its reward is ``>= success_threshold`` (default 1.0): the built-in rewards
(``math``, ``gsm8k``, ``exact``) give 1.0 for a correct answer and 0.0 otherwise, ±1 rewards pass at +1, and
``f1`` passes only on a full match. A FAILED sample counts as reward 0.0 (and so fails) whatever its reward.
"""

from __future__ import annotations

import math

from vime.utils.types import Sample, Status


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` pass: ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def compute_eval_metrics(
    name: str,
    groups: list[list[Sample]],
    reward_key: str | None = None,
    success_threshold: float = 1.0,
) -> dict[str, float]:
    """Metrics for one eval dataset; ``groups`` holds the samples of each prompt.

    Keys, all under ``eval/{name}/``: ``mean_reward``; ``pass@k`` for k = 1, 2, 4, ... up to the smallest
    group (each prompt's unbiased estimate, averaged over prompts); ``truncation_rate`` (share of TRUNCATED
    samples); ``failed`` (count of FAILED samples); ``num_samples``; ``response_length_mean`` (over samples
    that did not fail, 0.0 if all failed).
    """
    if not groups:
        raise ValueError(f"eval dataset {name!r}: no groups to score")
    if empty := [position for position, group in enumerate(groups) if not group]:
        raise ValueError(f"eval dataset {name!r}: groups {empty} have no samples")
    samples = [sample for group in groups for sample in group]
    rewards = [_reward(sample, reward_key) for sample in samples]
    prefix = f"eval/{name}/"
    metrics = {prefix + "mean_reward": sum(rewards) / len(rewards)}
    metrics |= {
        prefix + key: value for key, value in pass_rates(groups, reward_key, success_threshold).items()
    }
    lengths = [sample.response_length for sample in samples if sample.status != Status.FAILED]
    metrics[prefix + "truncation_rate"] = sum(s.status == Status.TRUNCATED for s in samples) / len(samples)
    metrics[prefix + "failed"] = float(len(samples) - len(lengths))
    metrics[prefix + "num_samples"] = float(len(samples))
    metrics[prefix + "response_length_mean"] = sum(lengths) / len(lengths) if lengths else 0.0
    return metrics


def pass_rates(
    groups: list[list[Sample]], reward_key: str | None = None, success_threshold: float = 1.0
) -> dict[str, float]:
    """``pass@k`` for k = 1, 2, 4, ... up to the smallest group: each group's unbiased estimate, averaged."""
    rates = {}
    k = 1
    while groups and k <= min(len(group) for group in groups):
        estimates = [
            pass_at_k(len(group), sum(_reward(s, reward_key) >= success_threshold for s in group), k)
            for group in groups
        ]
        rates[f"pass@{k}"] = sum(estimates) / len(estimates)
        k *= 2
    return rates


def _reward(sample: Sample, reward_key: str | None) -> float:
    return 0.0 if sample.status == Status.FAILED else sample.reward_value(reward_key)
