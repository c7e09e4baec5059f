"""Train-inference mismatch corrections and metrics (vime.utils.mismatch) on hand-worked numbers, and the policy
loss with each correction: unchanged when every ratio is 1."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from vime.utils import mismatch
from vime.utils.loss import make_reducer, policy_loss

LN2 = math.log(2.0)


def t(values):
    return torch.tensor(values, dtype=torch.float32)


def _args(**overrides):
    base = dict(advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None, use_tis=False,
                entropy_coef=0.0, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1", use_unbiased_kl=False,
                use_opsm=False, opsm_delta=1e-4, pg_loss_type="ppo", use_score_centering=False, custom_tis_function_path=None, tis_clip=2.0, tis_clip_low=0.5,
                custom_pg_loss_reducer_function_path=None, calculate_per_token_loss=False)  # fmt: skip
    return argparse.Namespace(**{**base, **overrides})


def _call(fn, train, rollout, lengths, args=None, pg=None):
    pg = pg if pg is not None else torch.ones(sum(lengths))
    masks = [torch.ones(n) for n in lengths]
    return fn(args or _args(), pg_loss=pg, train_log_probs=list(t(train).split(lengths)),
              rollout_log_probs=list(t(rollout).split(lengths)), loss_masks=masks)  # fmt: skip


def test_token_truncated_is():
    # ratios e, 1/e, e^-0.1 -> clamped to [0.5, 2]
    loss, masks, metrics = _call(mismatch.vanilla_tis_function, [0.0, 0.0, 0.0], [-1.0, 1.0, 0.1], [3])
    assert loss.tolist() == pytest.approx([2.0, 0.5, math.exp(-0.1)])
    assert metrics["tis_clipfrac"].tolist() == [1.0, 1.0, 0.0]
    assert metrics["tis"].tolist() == pytest.approx([math.e, 1 / math.e, math.exp(-0.1)])
    assert torch.equal(masks[0], torch.ones(3))


def test_geometric_sequence_is():
    # sequence 1: r = [0.2, 0.4] -> exp(0.3) = 1.35 clamped to 1.2; sequence 2: r = -1 -> 0.37 clamped to 0.5
    args = _args(tis_clip_low=0.5, tis_clip=1.2)
    loss, _, metrics = _call(mismatch.geometric_tis_function, [0.2, 0.4, -1.0], [0.0, 0.0, 0.0], [2, 1], args)
    assert loss.tolist() == pytest.approx([1.2, 1.2, 0.5])
    assert metrics["tis"].tolist() == pytest.approx([math.exp(0.3)] * 2 + [math.exp(-1.0)])


def test_icepop_masks_both_sides_and_keeps_the_ratio_inside():
    loss, masks, metrics = _call(
        mismatch.icepop_function, [math.log(2.5), 0.0, math.log(0.3)], [0.0] * 3, [3]
    )
    assert loss.tolist() == pytest.approx([0.0, 1.0, 0.0])
    assert metrics["tis_clipfrac"].tolist() == [1.0, 0.0, 1.0]


def test_rejection_drops_tokens_or_whole_sequences():
    pg = t([3.0, 3.0, 3.0])
    loss, masks, metrics = _call(
        mismatch.token_mask_function, [math.log(2.5), 0.0, 0.0], [0.0] * 3, [2, 1], pg=pg
    )
    assert loss.tolist() == [0.0, 3.0, 3.0]  # kept tokens keep weight 1
    assert [m.tolist() for m in masks] == [[0.0, 1.0], [1.0]]
    # sequence 1's geometric ratio exp(ln(2.5) / 2) = 1.58 is inside [0.5, 2]; sequence 2's 2.5 is not
    loss, masks, _ = _call(
        mismatch.sequence_mask_function, [math.log(2.5), 0.0, math.log(2.5)], [0.0] * 3, [2, 1], pg=pg
    )
    assert loss.tolist() == [3.0, 3.0, 0.0]
    assert [m.tolist() for m in masks] == [[1.0, 1.0], [0.0]]


def test_opsm_masks_negative_advantage_sequences_that_moved_too_far():
    # three sequences of 2 tokens: old - new mean 0.3 (A < 0: masked), 0.3 (A > 0: kept), 1e-5 (A < 0: kept)
    new = t([-1.0, -1.0, -1.0, -1.0, -1.0, -1.0])
    old = t([-0.7, -0.7, -0.7, -0.7, -1.0 + 1e-5, -1.0 + 1e-5])
    adv = t([-1.0, -1.0, 1.0, 1.0, -1.0, -1.0])
    keep = mismatch.opsm_mask(new, old, adv, torch.ones(6), [2, 2, 2], delta=1e-4)
    assert keep.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "correction",
    [None, "vanilla_tis_function", "geometric_tis_function", "icepop_function", "token_mask_function",
     "sequence_mask_function", "opsm"],
)  # fmt: skip
def test_policy_loss_is_unchanged_when_every_ratio_is_one(correction):
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(7, generator=gen)
    mask = t([1, 1, 1, 0, 1, 1, 1])
    batch = {
        "response_lengths": [3, 4], "loss_mask": mask, "advantages": torch.randn(7, generator=gen),
        "old_log_probs": old, "ref_log_probs": None, "rollout_log_probs": old.clone(),
        "reduce": make_reducer(mask, [3, 4], False, 2, 6),
    }  # fmt: skip

    def run(args):
        log_probs = old.clone().requires_grad_(True)
        loss, metrics = policy_loss(args, batch, log_probs, None)
        loss.backward()
        return loss.detach(), log_probs.grad, metrics

    plain_loss, plain_grad, _ = run(_args())
    if correction == "opsm":
        args = _args(use_opsm=True)
    elif correction is not None:
        args = _args(use_tis=True, custom_tis_function_path=f"vime.utils.mismatch.{correction}")
    else:
        args = _args(use_tis=True)  # the default TIS function
    loss, grad, metrics = run(args)
    assert torch.equal(loss, plain_loss) and torch.equal(grad, plain_grad)
    if correction != "opsm":
        assert metrics["tis_clipfrac"].item() == 0.0 and metrics["ois"].item() == pytest.approx(1.0)
    else:
        assert metrics["opsm_clipfrac"].item() == 0.0


def test_policy_loss_applies_tis_and_a_custom_pg_loss_reducer(monkeypatch):
    old, rollout = t([0.0, 0.0]), t([-1.0, 0.0])  # ratios e (clamped to 2) and 1
    mask = torch.ones(2)
    batch = {
        "response_lengths": [2], "total_lengths": [5], "loss_mask": mask, "advantages": t([1.0, 1.0]),
        "old_log_probs": old, "ref_log_probs": None, "rollout_log_probs": rollout,
        "reduce": make_reducer(mask, [2], False, 1, 2),
    }  # fmt: skip
    seen = {}

    def sum_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
        seen.update(total=total_lengths, lengths=response_lengths, masks=[m.tolist() for m in loss_masks])
        return lambda per_token: per_token.sum()

    monkeypatch.setattr(mismatch, "sum_reducer_for_test", sum_reducer, raising=False)
    args = _args(
        use_tis=True, custom_pg_loss_reducer_function_path="vime.utils.mismatch.sum_reducer_for_test"
    )
    loss, metrics = policy_loss(args, batch, old.clone(), None)
    # per-token PPO loss at ratio 1 is -A = -1; TIS weights [2, 1]; summed by the custom reducer
    assert metrics["pg_loss"].item() == pytest.approx(-3.0)
    assert seen == {"total": [5], "lengths": [2], "masks": [[1.0, 1.0]]}
    assert metrics["tis_clipfrac"].item() == pytest.approx(0.5)  # default reduce: mean of [1, 0]


def test_mismatch_metrics_hand_worked():
    # sample 1: r = [0, ln 2] (ratios 1, 2); sample 2: r = -ln 2 (ratio 0.5)
    train = [t([-1.0, -2.0]), t([-0.5])]
    rollout = [t([-1.0, -2.0 - LN2]), t([-0.5 + LN2])]
    masks = [torch.ones(2), torch.ones(1)]
    sums, maxima = mismatch.mismatch_statistics(train, rollout, masks, band=(0.6, 1.5))
    m = mismatch.mismatch_metrics(sums, maxima)
    assert m["mismatch/k1"] == pytest.approx(0.0, abs=1e-7)
    assert m["mismatch/k3"] == pytest.approx(0.5 / 3)  # (0 + (2 - ln2 - 1) + (0.5 + ln2 - 1)) / 3
    assert m["mismatch/ratio"] == pytest.approx(3.5 / 3)
    assert (m["mismatch/ratio_min"], m["mismatch/ratio_max"]) == pytest.approx((0.5, 2.0))
    assert m["mismatch/ratio_above_2_fraction"] == 0.0 and m["mismatch/ratio_below_0.5_fraction"] == 0.0
    assert m["mismatch/tis_band_out_fraction"] == pytest.approx(2 / 3)
    assert m["mismatch/abs_diff"] == pytest.approx(2 * LN2 / 3)
    assert m["mismatch/train_log_ppl"] == pytest.approx(3.5 / 3)
    assert m["mismatch/seq_k1"] == pytest.approx(LN2 / 4)  # mean of -ln2/2 and ln2
    assert m["mismatch/seq_ratio"] == pytest.approx((math.sqrt(2) + 0.5) / 2)
    assert (m["mismatch/seq_ratio_min"], m["mismatch/seq_ratio_max"]) == pytest.approx((0.5, math.sqrt(2)))
    assert m["mismatch/abs_diff_pos_0"] == pytest.approx(2 * LN2 / 3) and "mismatch/k1_pos_256" not in m


def test_mismatch_metrics_skip_masked_tokens_and_bucket_positions():
    # 300 tokens, r = 0.1 on the first 256 and 0.3 after; the last token is masked out (r would be 5)
    train = [torch.cat([torch.full((256,), 0.1), torch.full((43,), 0.3), t([5.0])])]
    rollout = [torch.zeros(300)]
    mask = torch.ones(300)
    mask[-1] = 0
    m = mismatch.mismatch_metrics(*mismatch.mismatch_statistics(train, rollout, [mask], band=(0.5, 2.0)))
    assert m["mismatch/k1_pos_0"] == pytest.approx(-0.1) and m["mismatch/k1_pos_256"] == pytest.approx(-0.3)
    assert m["mismatch/ratio_max"] == pytest.approx(math.exp(0.3))
