"""Optional rollout metrics over a batch's samples, whatever rollout function made them (slime's
``--log-multi-turn``, ``--log-reward-category`` and ``--log-correct-samples``); the rollout manager adds them."""

from __future__ import annotations

import argparse
import math
from collections import Counter

from vime.utils.types import Sample, Status


def sample_metrics(args: argparse.Namespace, samples: list[Sample]) -> dict[str, float]:
    """The metrics the flags ask for (none without them)."""
    metrics: dict[str, float] = {}
    if args.log_multi_turn:
        metrics |= multi_turn_metrics(samples, args.rollout_max_response_len)
    if args.log_reward_category:
        metrics |= reward_category_metrics(samples, args.log_reward_category)
    if args.log_correct_samples:
        metrics |= correct_sample_metrics(samples, args.rollout_max_response_len, args.reward_key)
    return metrics


def _stats(prefix: str, values: list[float]) -> dict[str, float]:
    return {
        f"{prefix}_mean": sum(values) / len(values),
        f"{prefix}_max": float(max(values)),
        f"{prefix}_min": float(min(values)),
    }


def multi_turn_metrics(samples: list[Sample], max_response_len: int) -> dict[str, float]:
    """Response lengths with and without the masked (tool / environment) tokens, the share of responses that
    reached ``max_response_len``, and the number of rounds (``metadata["round_number"]``) where samples give it."""
    if not samples:
        return {}
    raw = [float(s.response_length) for s in samples]
    trained = [float(sum(s.loss_mask) if s.loss_mask is not None else s.response_length) for s in samples]
    metrics = _stats("multi_turn/raw_response_length", raw)
    metrics["multi_turn/raw_response_length_clip_ratio"] = sum(n >= max_response_len for n in raw) / len(raw)
    metrics |= _stats("multi_turn/wo_obs_response_length", trained)
    rounds = [float(s.metadata["round_number"]) for s in samples if "round_number" in (s.metadata or {})]
    if rounds:
        metrics |= _stats("multi_turn/round_number", rounds)
    return metrics


def reward_category_metrics(samples: list[Sample], key: str) -> dict[str, float]:
    """The share of samples for each value of ``reward[key]`` (e.g. why a grader failed an answer)."""
    missing = [s.index for s in samples if not isinstance(s.reward, dict) or key not in s.reward]
    if missing:
        raise ValueError(
            f"--log-reward-category {key}: samples {missing[:5]} have no reward dict with key {key!r}; the reward "
            "function must return a dict holding it"
        )
    counts = Counter(str(s.reward[key]) for s in samples)
    return {f"error_cat/{category}": count / len(samples) for category, count in counts.items()}


def correct_sample_metrics(
    samples: list[Sample], max_response_len: int, reward_key: str | None
) -> dict[str, float]:
    """For samples whose reward is 1: their count, the share of them whose length falls in each quarter of
    ``max_response_len`` (``p25`` ... ``p100``), and their mean negative rollout log-prob (slime's entropy proxy)."""
    correct = [s for s in samples if s.status != Status.FAILED and s.reward_value(reward_key) == 1]
    metrics = {"correct/num_samples": float(len(correct))}
    if not correct:
        return metrics
    quarters = [0] * 4
    for s in correct:
        quarters[min(max(math.ceil(4 * s.response_length / max_response_len) - 1, 0), 3)] += 1
    metrics |= {f"correct/length_p{25 * (i + 1)}": n / len(correct) for i, n in enumerate(quarters)}
    per_sample = []
    for s in correct:
        mask = s.loss_mask if s.loss_mask is not None else [1] * s.response_length
        if s.rollout_log_probs and sum(mask):
            per_sample.append(
                -sum(lp * m for lp, m in zip(s.rollout_log_probs, mask, strict=True)) / sum(mask)
            )
    if per_sample:
        metrics["correct/entropy"] = sum(per_sample) / len(per_sample)
    return metrics
