"""Eval metrics: the unbiased pass@k estimator against hand-worked values, and the per-dataset metrics."""

from __future__ import annotations

import pytest

from vime.rollout.eval_metrics import compute_eval_metrics, pass_at_k
from vime.utils.types import Sample, Status


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 1, 1, 0.25),
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (4, 0, 4, 0.0),
        (4, 4, 1, 1.0),
        (5, 2, 4, 1.0),  # fewer than k failures: every k-subset holds a pass
        (10, 3, 4, 1 - 35 / 210),  # C(7,4) = 35, C(10,4) = 210
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_1_is_the_pass_rate_and_large_n_is_finite():
    assert pass_at_k(7, 3, 1) == pytest.approx(3 / 7)
    assert pass_at_k(2000, 1, 1024) == pytest.approx(1024 / 2000)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match=f"n={n}, c={c}, k={k}"):
        pass_at_k(n, c, k)


def sample(reward, status=Status.COMPLETED, length=10) -> Sample:
    return Sample(reward=reward, status=status, response_length=length)


def test_compute_eval_metrics_hand_checked():
    groups = [
        [sample(1.0, length=4), sample(0.0, Status.TRUNCATED, 8), sample(0.0), sample(0.0)],
        [sample(1.0), sample(1.0), sample(0.5, length=2), sample(None, Status.FAILED, 0)],
    ]
    metrics = compute_eval_metrics("gsm8k", groups)
    assert metrics == pytest.approx(
        {
            "eval/gsm8k/mean_reward": 3.5 / 8,
            "eval/gsm8k/pass@1": (1 / 4 + 2 / 4) / 2,  # 0.5 is below the 1.0 threshold
            "eval/gsm8k/pass@2": (0.5 + 5 / 6) / 2,
            "eval/gsm8k/pass@4": 1.0,
            "eval/gsm8k/truncation_rate": 1 / 8,
            "eval/gsm8k/failed": 1.0,
            "eval/gsm8k/num_samples": 8.0,
            "eval/gsm8k/response_length_mean": (4 + 8 + 10 + 10 + 10 + 10 + 2) / 7,
        }
    )


def test_threshold_and_pass_at_k_up_to_smallest_group():
    groups = [[sample(0.5), sample(0.0), sample(0.0)], [sample(0.0), sample(0.0), sample(0.0)]]
    assert compute_eval_metrics("a", groups)["eval/a/pass@1"] == 0.0
    metrics = compute_eval_metrics("a", groups, success_threshold=0.5)
    assert metrics["eval/a/pass@1"] == pytest.approx(1 / 6)
    assert sorted(k for k in metrics if "pass@" in k) == ["eval/a/pass@1", "eval/a/pass@2"]
    uneven = [[sample(1.0), sample(0.0)], [sample(0.0)] * 4]
    assert [k for k in compute_eval_metrics("a", uneven) if "pass@" in k] == [
        "eval/a/pass@1",
        "eval/a/pass@2",
    ]


def test_failed_samples_score_zero_even_with_a_reward():
    groups = [[sample(1.0, Status.FAILED), sample(1.0)]]
    metrics = compute_eval_metrics("a", groups)
    assert metrics["eval/a/mean_reward"] == 0.5 and metrics["eval/a/pass@1"] == 0.5
    assert metrics["eval/a/failed"] == 1.0


def test_all_failed_reports_zero_length():
    metrics = compute_eval_metrics("a", [[sample(None, Status.FAILED, 0)]])
    assert metrics["eval/a/response_length_mean"] == 0.0 and metrics["eval/a/mean_reward"] == 0.0


def test_dict_rewards_use_the_reward_key():
    groups = [[sample({"acc": 1.0, "fmt": 0.0}), sample({"acc": 0.0, "fmt": 1.0})]]
    assert compute_eval_metrics("a", groups, reward_key="acc")["eval/a/mean_reward"] == 0.5
    with pytest.raises(ValueError, match="--reward-key"):
        compute_eval_metrics("a", groups)


def test_rejects_missing_rewards_and_empty_groups():
    with pytest.raises(ValueError, match="no reward yet"):
        compute_eval_metrics("a", [[sample(None)]])
    with pytest.raises(ValueError, match="no groups"):
        compute_eval_metrics("a", [])
    with pytest.raises(ValueError, match=r"groups \[1\] have no samples"):
        compute_eval_metrics("a", [[sample(1.0)], []])


def test_pass_rates_for_log_passrate():
    from vime.rollout.eval_metrics import pass_rates

    def group(*rewards):
        return [Sample(reward=r, status=Status.COMPLETED) for r in rewards]

    # groups of 4: one with 1 pass (pass@1 1/4, pass@2 1 - C(3,2)/C(4,2) = 1/2, pass@4 1), one with none
    rates = pass_rates([group(1.0, 0.0, 0.0, 0.0), group(0.0, 0.0, 0.0, 0.0)])
    assert rates == pytest.approx({"pass@1": 0.125, "pass@2": 0.25, "pass@4": 0.5})
    assert pass_rates([]) == {}
