"""Hand-worked checks of the RL math in vime/utils/ppo_utils.py (DESIGN.md §6).

Expected numbers are derived in the comments and computed with plain ``math``, never by the function under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from vime.utils.ppo_utils import (
    apply_opd_kl,
    compute_approx_kl,
    compute_gspo_kl,
    compute_policy_loss,
    compute_tis_weights,
    compute_token_rewards,
    compute_value_loss,
    discounted_cumsum,
    entropy_from_logits,
    get_advantages_and_returns,
    get_grpo_returns,
    get_reinforce_plus_plus_baseline_advantages,
    get_reinforce_plus_plus_returns,
    log_probs_from_logits,
    masked_whiten,
    normalize_group_rewards,
    reduce_token_loss,
)


def t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def assert_values(actual: torch.Tensor, expected: list[float] | float) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


# ---------------------------------------------------------------------------------------------- KL estimators
def test_approx_kl_every_type():
    # d = logp − logp_ref = [0 − (−0.5), −1 − 0.5] = [0.5, −1.5]
    logp, ref = t([0.0, -1.0]), t([-0.5, 0.5])
    assert_values(compute_approx_kl(logp, ref, "k1"), [0.5, -1.5])
    assert_values(compute_approx_kl(logp, ref, "k2"), [0.5**2 / 2, 1.5**2 / 2])  # [0.125, 1.125]
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.5) - 1 - 1.5]  # exp(−d) − 1 + d
    assert_values(compute_approx_kl(logp, ref, "k3"), k3)
    assert_values(compute_approx_kl(logp, ref, "low_var_kl"), k3)  # both inside [−10, 10]


def test_low_var_kl_clamps_where_k3_does_not():
    # d = −20: k3 = exp(20) − 1 − 20 ≈ 4.85e8; low_var_kl clamps it to 10.
    logp, ref = t([-20.0]), t([0.0])
    assert_values(compute_approx_kl(logp, ref, "k3"), [math.exp(20) - 21])
    assert_values(compute_approx_kl(logp, ref, "low_var_kl"), [10.0])


def test_unbiased_kl_weights_by_the_importance_ratio_before_the_clamp():
    logp, ref = t([0.0, -1.0]), t([-0.5, 0.5])  # d = [0.5, -1.5]
    ratio = t([2.0, 0.5])
    assert_values(compute_approx_kl(logp, ref, "k1", ratio), [1.0, -0.75])
    assert_values(compute_approx_kl(logp, ref, "k1", t([1.0, 1.0])), [0.5, -1.5])  # ratio 1: unchanged
    # low_var_kl clamps the weighted value: 6 x (exp(1.5) - 2.5) = 11.9 becomes 10
    k3 = math.exp(1.5) - 1 - 1.5
    assert_values(compute_approx_kl(t([-1.0]), t([0.5]), "low_var_kl", t([6.0])), [min(6 * k3, 10.0)])


def test_approx_kl_unknown_type_names_valid_ones():
    with pytest.raises(ValueError, match="low_var_kl"):
        compute_approx_kl(t([0.0]), t([0.0]), "k4")


# ------------------------------------------------------------------------------------------- reward shaping
REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]  # two groups of 4


def test_group_normalization_with_sample_std():
    # group 1: mean 0.5, squared deviations 4·0.25 = 1, unbiased var 1/3 → std √(1/3)
    # group 2: mean 0.75, squared deviations 3·0.0625 + 0.5625 = 0.75, unbiased var 0.25 → std 0.5
    # (the population std would be √0.1875 ≈ 0.433, so this pins the unbiased choice)
    s1, s2 = math.sqrt(1 / 3) + 1e-6, 0.5 + 1e-6
    expected = [0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1, 0.25 / s2, 0.25 / s2, 0.25 / s2, -0.75 / s2]
    assert_values(normalize_group_rewards(t(REWARDS), 4), expected)


def test_group_normalization_mean_only():
    expected = [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]
    assert_values(normalize_group_rewards(t(REWARDS), 4, normalize_std=False), expected)


def test_group_normalization_rejects_bad_shapes():
    with pytest.raises(ValueError, match="divisible"):
        normalize_group_rewards(t(REWARDS), 3)
    with pytest.raises(ValueError, match=">= 2"):
        normalize_group_rewards(t(REWARDS), 1)


# ------------------------------------------------------------------------------------------------ advantages
def test_discounted_cumsum_matches_a_plain_loop_across_chunks():
    torch.manual_seed(0)
    values = torch.randn(300)
    for discount, chunk_size in [(0.9, 7), (0.97, 128), (1.0, 16), (0.0, 5)]:
        running, expected = 0.0, []
        for x in reversed(values.tolist()):  # G_t = x_t + γ·G_{t+1}
            running = x + discount * running
            expected.append(running)
        torch.testing.assert_close(
            discounted_cumsum(values, discount, chunk_size),
            torch.tensor(expected[::-1]),
            rtol=1e-5,
            atol=1e-4,
        )


def test_grpo_returns_broadcast_each_reward():
    returns = get_grpo_returns(t([0.5, -1.0]), [torch.zeros(3), torch.zeros(2)])
    assert_values(returns[0], [0.5, 0.5, 0.5])
    assert_values(returns[1], [-1.0, -1.0])


def test_token_rewards_put_reward_on_last_masked_token():
    # −kl_coef·d_t·m_t = [−0.1, −0.2, 0]; r = 1 lands on index 1 (the last m_t = 1), not on index 2
    assert_values(compute_token_rewards(1.0, t([0.2, 0.4, 0.6]), t([1, 1, 0]), 0.5), [-0.1, 0.8, 0.0])
    assert_values(compute_token_rewards(1.0, t([0.2, 0.4]), t([0, 0]), 0.5), [0.0, 0.0])  # fully masked


def test_reinforce_plus_plus_returns_with_trailing_mask_zeros():
    # kl_coef 0.5, γ 0.9, r 1, mask [1, 1, 1, 0]: token rewards [−0.05, −0.1, −0.15 + 1, 0]
    # G_2 = 0.85; G_1 = −0.1 + 0.9·0.85; G_0 = −0.05 + 0.9·G_1; masked-out G_3 = 0
    g2 = 0.85
    g1 = -0.1 + 0.9 * g2
    g0 = -0.05 + 0.9 * g1
    (returns,) = get_reinforce_plus_plus_returns(
        t([1.0]), [t([0.1, 0.2, 0.3, 0.4])], [t([1, 1, 1, 0])], 0.5, 0.9
    )
    assert_values(returns, [g0, g1, g2, 0.0])


def test_reinforce_plus_plus_skips_unmasked_tokens_in_the_middle():
    # mask [1, 0, 1] (e.g. a tool output in the middle): the middle KL (5.0) is ignored and is no discount step.
    # token rewards [−0.05, 0, −0.1 + 2]; G_2 = 1.9; G_0 = −0.05 + 0.9·1.9
    (returns,) = get_reinforce_plus_plus_returns(t([2.0]), [t([0.1, 5.0, 0.2])], [t([1, 0, 1])], 0.5, 0.9)
    assert_values(returns, [-0.05 + 0.9 * 1.9, 0.0, 1.9])


def test_reinforce_plus_plus_baseline_advantages():
    # A_t = r̃ − kl_coef·d_t·m_t = [0.5 − 0.1·0.2, 0.5 − 0·(−0.4)]
    (adv,) = get_reinforce_plus_plus_baseline_advantages(t([0.5]), [t([0.2, -0.4])], [t([1, 0])], 0.1)
    assert_values(adv, [0.5 - 0.1 * 0.2, 0.5])


def test_gae_three_tokens():
    # V = [0.5, 0.4, 0.3], r = [0, 0, 1], γ = 0.9, λ = 0.8 (γλ = 0.72), V past the end = 0
    # δ_2 = 1 − 0.3 = 0.7; δ_1 = 0.9·0.3 − 0.4 = −0.13; δ_0 = 0.9·0.4 − 0.5 = −0.14
    # A_2 = 0.7; A_1 = −0.13 + 0.72·0.7 = 0.374; A_0 = −0.14 + 0.72·0.374 = 0.12928
    a2 = 0.7
    a1 = -0.13 + 0.72 * a2
    a0 = -0.14 + 0.72 * a1
    adv, ret = get_advantages_and_returns(t([0.5, 0.4, 0.3]), t([0.0, 0.0, 1.0]), t([1, 1, 1]), 0.9, 0.8)
    assert_values(adv, [a0, a1, a2])
    assert_values(ret, [a0 + 0.5, a1 + 0.4, a2 + 0.3])


def test_gae_skips_unmasked_tokens():
    # mask [1, 0, 1]: steps are tokens 0 and 2 (V 0.5, 0.3; r 0, 1); token 1's V = 9 and r = 7 are ignored.
    # δ_2 = 1 − 0.3 = 0.7; δ_0 = 0.9·0.3 − 0.5 = −0.23; A_0 = −0.23 + 0.72·0.7; A_1 = 0, return_1 = V_1 = 9
    adv, ret = get_advantages_and_returns(t([0.5, 9.0, 0.3]), t([0.0, 7.0, 1.0]), t([1, 0, 1]), 0.9, 0.8)
    a0 = -0.23 + 0.72 * 0.7
    assert_values(adv, [a0, 0.0, 0.7])
    assert_values(ret, [a0 + 0.5, 9.0, 1.0])


def test_opd_kl():
    # A − 0.2·(logp_s − logp_t) = [1 − 0.2·0.5, −0.5 − 0.2·(−1)]
    assert_values(apply_opd_kl(t([1.0, -0.5]), t([-1.0, -2.0]), t([-1.5, -1.0]), 0.2), [0.9, -0.3])


def test_masked_whiten():
    # masked values [1, 3, 5]: mean 3, unbiased var (4 + 0 + 4)/2 = 4 → std 2; the unmasked 100 is transformed too
    values, mask = t([1.0, 3.0, 5.0, 100.0]), t([1, 1, 1, 0])
    std = math.sqrt(4 + 1e-8)
    assert_values(masked_whiten(values, mask), [-2 / std, 0.0, 2 / std, 97 / std])
    assert_values(
        masked_whiten(values, mask, shift_mean=False), [3 - 2 / std, 3.0, 3 + 2 / std, 3 + 97 / std]
    )
    with pytest.raises(ValueError, match="no tokens"):
        masked_whiten(values, t([0, 0, 0, 0]))


# ----------------------------------------------------------------------------------------------------- losses
def test_gspo_kl_is_the_masked_sequence_mean_broadcast():
    # sample 0: old − new = [−0.5, 0, 1], mask [1, 1, 0] → (−0.5 + 0)/2 = −0.25 on all 3 tokens
    # sample 1: old − new = 0.1; sample 2: fully masked → 0
    kl = compute_gspo_kl(
        [t([-1.0, -2.0, -3.0]), t([-0.2]), t([-1.0, -1.0])],
        [t([-1.5, -2.0, -2.0]), t([-0.1]), t([0.0, 0.0])],
        [t([1, 1, 0]), t([1]), t([0, 0])],
    )
    assert_values(kl, [-0.25, -0.25, -0.25, 0.1, 0.0, 0.0])


# (ratio, A, expected loss, expected clipfrac) with eps_clip 0.2, eps_clip_high 0.3 → clip range [0.8, 1.3]
POLICY_CASES = [
    (1.5, 1.0, -1.3, 1.0),  # above range, A > 0: max(−1.5, −1.3) picks the clipped branch
    (1.25, 1.0, -1.25, 0.0),  # inside the asymmetric high bound (a symmetric 0.2 would give −1.2)
    (1.1, 1.0, -1.1, 0.0),  # inside range
    (0.5, 1.0, -0.5, 0.0),  # below range, A > 0: max(−0.5, −0.8) keeps the unclipped term
    (0.5, -1.0, 0.8, 1.0),  # below range, A < 0: max(0.5, 0.8) picks the clipped branch
    (0.9, -1.0, 0.9, 0.0),  # inside range
    (1.5, -1.0, 1.5, 0.0),  # above range, A < 0: max(1.5, 1.3) keeps the unclipped term
]


def test_policy_loss_clip_cases():
    ratios, advs, losses, fracs = (list(col) for col in zip(*POLICY_CASES, strict=True))
    ppo_kl = t([-math.log(r) for r in ratios])  # ratio = exp(−ppo_kl)
    pg_losses, clipfrac = compute_policy_loss(ppo_kl, t(advs), 0.2, 0.3)
    assert_values(pg_losses, losses)
    assert_values(clipfrac, fracs)


def test_policy_loss_dual_clip():
    # eps_clip_c = 3, clip range [0.8, 1.3]:
    # ratio 5, A = −1: max(5, 1.3) = 5 → min(5, 3) = 3
    # ratio 5, A = +1: max(−5, −1.3) = −1.3, untouched (dual clip is for A < 0 only; min(−1.3, −3) would be −3)
    # ratio 0.5, A = −1: max(0.5, 0.8) = 0.8 → min(0.8, 3) = 0.8
    ppo_kl = t([-math.log(5.0), -math.log(5.0), -math.log(0.5)])
    pg_losses, clipfrac = compute_policy_loss(ppo_kl, t([-1.0, 1.0, -1.0]), 0.2, 0.3, eps_clip_c=3.0)
    assert_values(pg_losses, [3.0, -1.3, 0.8])
    assert_values(clipfrac, [0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="> 1"):
        compute_policy_loss(ppo_kl, t([-1.0, 1.0, -1.0]), 0.2, 0.3, eps_clip_c=1.0)


def test_value_loss_clipped_and_unclipped():
    # V = [1, 2, 0], V_old = 0.5, R = [0, 3, 0], c = 0.2 → clip(V) = [0.7, 0.7, 0.3]
    # t0: max((1−0)², (0.7−0)²) = 1 → 0.5, not clipped
    # t1: max((2−3)², (0.7−3)²) = 5.29 → 2.645, clipped
    # t2: max((0−0)², (0.3−0)²) = 0.09 → 0.045, clipped
    values, old_values, returns = t([1.0, 2.0, 0.0]), t([0.5, 0.5, 0.5]), t([0.0, 3.0, 0.0])
    loss, clipfrac = compute_value_loss(values, old_values, returns, 0.2)
    assert_values(loss, [0.5, 0.5 * 2.3**2, 0.5 * 0.3**2])
    assert_values(clipfrac, [0.0, 1.0, 1.0])
    loss, clipfrac = compute_value_loss(values, old_values, returns, None)  # 0.5·(V − R)²
    assert_values(loss, [0.5, 0.5, 0.0])
    assert_values(clipfrac, [0.0, 0.0, 0.0])


def test_tis_weights_clamp_both_sides_and_are_detached():
    # exp(0 − (−1)) = e → clamped to 2; exp(0 − 1) = 0.368 → clamped to 0.5; exp(−0.1) = 0.905 kept
    old = torch.zeros(3, requires_grad=True)
    weights = compute_tis_weights(old, t([-1.0, 1.0, 0.1]), 0.5, 2.0)
    assert_values(weights, [2.0, 0.5, math.exp(-0.1)])
    assert not weights.requires_grad
    with pytest.raises(ValueError, match="tis_clip_low"):
        compute_tis_weights(old, t([0.0, 0.0, 0.0]), 2.0, 1.0)


# ------------------------------------------------------------------------------------- log-probs and entropy
def test_log_probs_and_entropy_from_logits_with_temperature():
    # temperature 2: row 0 → z = [0.5, 1, 1.5], label 2: 1.5 − log(e^0.5 + e^1 + e^1.5); row 1 uniform: −log 3
    logits = t([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    before = logits.clone()
    z = [0.5, 1.0, 1.5]
    log_z = math.log(sum(math.exp(v) for v in z))
    assert_values(
        log_probs_from_logits(logits, torch.tensor([2, 1]), temperature=2.0), [1.5 - log_z, -math.log(3)]
    )
    p = [math.exp(v - log_z) for v in z]  # H = −Σ p log p
    entropy = [-sum(pi * math.log(pi) for pi in p), math.log(3)]
    assert_values(entropy_from_logits(logits, temperature=2.0), entropy)
    torch.testing.assert_close(logits, before)  # the caller's fp32 logits are not scaled in place


def test_log_probs_are_fp32_for_bf16_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    log_probs = log_probs_from_logits(logits, torch.tensor([3]))
    assert log_probs.dtype == torch.float32
    assert_values(log_probs, [-math.log(4)])
    assert entropy_from_logits(logits).dtype == torch.float32


# -------------------------------------------------------------------------------------------------- reduction
LOSS, MASK, LENGTHS = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [1, 1, 0, 1, 1, 0], [3, 2, 1]


def test_reduce_per_sample_mean():
    # sample means over masked tokens: (1 + 2)/2 = 1.5, (4 + 5)/2 = 4.5, fully masked third sample 0
    # summed = 6, divided by the global number of samples 4 → 1.5
    loss = reduce_token_loss(t(LOSS), t(MASK), LENGTHS, False, global_num_samples=4, global_num_tokens=99)
    assert_values(loss, 1.5)


def test_reduce_per_token():
    # (1 + 2 + 4 + 5) / global masked tokens 6 = 2
    loss = reduce_token_loss(t(LOSS), t(MASK), LENGTHS, True, global_num_samples=99, global_num_tokens=6)
    assert_values(loss, 2.0)


def test_reduce_rejects_lengths_that_do_not_cover_the_stream():
    with pytest.raises(ValueError, match="sum\\(sample_lengths\\)"):
        reduce_token_loss(t(LOSS), t(MASK), [3, 2], False, global_num_samples=2, global_num_tokens=4)


def _micro_batch_loss(
    logits, labels, lengths, old_lp, rollout_lp, ref_lp, adv, mask, use_gspo, per_token_mode, n, m
):
    """A realistic per-token objective (PPO or GSPO ratio, TIS, KL loss, entropy bonus) reduced globally."""
    log_probs = log_probs_from_logits(logits, labels, temperature=0.7)
    if use_gspo:
        split = lambda x: list(torch.split(x, lengths))  # noqa: E731
        ppo_kl = compute_gspo_kl(split(log_probs), split(old_lp), split(mask))
    else:
        ppo_kl = old_lp - log_probs
    pg_loss, _ = compute_policy_loss(ppo_kl, adv, 0.2, 0.28, eps_clip_c=3.0)
    pg_loss = pg_loss * compute_tis_weights(old_lp, rollout_lp, 0.5, 2.0)
    kl = compute_approx_kl(log_probs, ref_lp, "low_var_kl")
    per_token = pg_loss + 0.01 * kl - 0.001 * entropy_from_logits(logits, temperature=0.7)
    return reduce_token_loss(per_token, mask, lengths, per_token_mode, n, m)


@pytest.mark.parametrize("use_gspo", [False, True])
@pytest.mark.parametrize("calculate_per_token_loss", [False, True])
def test_micro_batching_does_not_change_loss_or_gradients(use_gspo, calculate_per_token_loss):
    gen = torch.Generator().manual_seed(0)
    lengths, vocab = [3, 7, 2, 5, 4, 6], 11
    total = sum(lengths)
    base_logits = torch.randn(total, vocab, generator=gen)
    labels = torch.randint(0, vocab, (total,), generator=gen)
    with torch.no_grad():
        lp = log_probs_from_logits(base_logits, labels, temperature=0.7)
    old_lp = lp + 0.3 * torch.randn(total, generator=gen)
    rollout_lp = old_lp + 0.3 * torch.randn(total, generator=gen)
    ref_lp = lp + 0.5 * torch.randn(total, generator=gen)
    adv = torch.cat(
        [torch.full((n,), float(a)) for n, a in zip(lengths, torch.randn(6, generator=gen), strict=True)]
    )
    mask = (torch.rand(total, generator=gen) > 0.3).float()
    mask[torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])] = 1.0  # ≥ 1 loss token per sample
    n_samples, n_tokens = len(lengths), int(mask.sum())

    def loss_of(logits, lo, hi, n, m):  # samples lo..hi−1 as one packed micro-batch
        s, e = sum(lengths[:lo]), sum(lengths[:hi])
        args = (labels[s:e], lengths[lo:hi], old_lp[s:e], rollout_lp[s:e], ref_lp[s:e], adv[s:e], mask[s:e])
        return _micro_batch_loss(logits[s:e], *args, use_gspo, calculate_per_token_loss, n, m)

    full_logits = base_logits.clone().requires_grad_()
    full_loss = loss_of(full_logits, 0, 6, n_samples, n_tokens)
    full_loss.backward()

    micro_logits = base_logits.clone().requires_grad_()
    summed, summed_local = torch.zeros(()), torch.zeros(())
    for lo, hi in [(0, 2), (2, 3), (3, 6)]:
        loss = loss_of(micro_logits, lo, hi, n_samples, n_tokens)
        loss.backward()
        summed += loss.detach()
        # Local denominators (what a naive trainer would use) must NOT reproduce the global loss: this data
        # is uneven enough for the invariance check above to fail if the reduction were wrong.
        local_tokens = int(mask[sum(lengths[:lo]) : sum(lengths[:hi])].sum())
        summed_local += loss_of(micro_logits, lo, hi, hi - lo, local_tokens).detach() / 3

    torch.testing.assert_close(summed, full_loss.detach())
    torch.testing.assert_close(micro_logits.grad, full_logits.grad)
    assert not torch.allclose(summed_local, full_loss.detach(), rtol=1e-3, atol=1e-4)


def test_reduce_per_trajectory_mean():
    # samples 0 and 1 are one trajectory of 4 masked tokens: (1 + 2 + 4 + 5) / 4 = 3; the third sample, fully
    # masked, is its own trajectory (0); divided by the global number of trajectories 2 → 1.5
    denominators = t([4.0, 4.0, 0.0])
    loss = reduce_token_loss(t(LOSS), t(MASK), LENGTHS, False, 2, 99, sample_denominators=denominators)
    assert_values(loss, 1.5)
