"""vime.utils.loss.policy_loss options checked on hand-made numbers: --use-unbiased-kl weights the KL loss by
the importance ratio pi/pi_old, and changes nothing when the policy has not moved."""

from __future__ import annotations

import argparse

import torch

from vime.utils.loss import make_reducer, policy_loss


def _args(**overrides) -> argparse.Namespace:
    base = dict(advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None, use_tis=False,
                entropy_coef=0.0, use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k1", use_unbiased_kl=False,
                use_opsm=False, opsm_delta=1e-4, pg_loss_type="ppo", use_score_centering=False, custom_tis_function_path=None, tis_clip=2.0, tis_clip_low=0.0,
                custom_pg_loss_reducer_function_path=None, calculate_per_token_loss=False)  # fmt: skip
    return argparse.Namespace(**{**base, **overrides})


def _batch(old_log_probs: list[float]) -> dict:
    mask = torch.ones(2)
    return {
        "response_lengths": [2], "loss_mask": mask, "advantages": torch.zeros(2),
        "old_log_probs": torch.tensor(old_log_probs), "ref_log_probs": torch.tensor([-1.0, -1.0]),
        "rollout_log_probs": None, "reduce": make_reducer(mask, [2], False, 1, 2),
    }  # fmt: skip


def test_unbiased_kl_is_the_ratio_weighted_kl():
    log_probs = torch.tensor([-0.5, -2.0])  # d = [0.5, -1.0]
    _, plain = policy_loss(_args(), _batch([-0.5, -2.0]), log_probs, None)
    _, same = policy_loss(_args(use_unbiased_kl=True), _batch([-0.5, -2.0]), log_probs, None)
    assert torch.isclose(plain["kl_loss"], torch.tensor(-0.25)) and torch.isclose(
        same["kl_loss"], plain["kl_loss"]
    )
    # pi/pi_old = exp([0.5, -0.5]): KL per token [0.5 e^0.5, -e^-0.5], sample mean of the two
    _, moved = policy_loss(_args(use_unbiased_kl=True), _batch([-1.0, -1.5]), log_probs, None)
    expected = (0.5 * torch.exp(torch.tensor(0.5)) - torch.exp(torch.tensor(-0.5))) / 2
    assert torch.isclose(moved["kl_loss"], expected)
