"""vime/utils/train_data.py: reward shaping, rollout partitions, micro-batches, packing, advantages."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from vime.utils import ppo_utils
from vime.utils.train_data import (
    balanced_partitions,
    compute_advantages_and_returns,
    dynamic_micro_batches,
    fixed_micro_batches,
    loss_mask_of,
    min_micro_batches,
    pack_samples,
    shape_rewards,
    split_rollout,
)
from vime.utils.types import Sample, Status


def make_args(**overrides) -> argparse.Namespace:
    base = dict(
        advantage_estimator="grpo",
        grpo_std_normalization=True,
        rewards_normalization=True,
        reward_key=None,
        kl_coef=0.0,
        kl_loss_type="k1",
        gamma=1.0,
        lambd=1.0,
    )
    return argparse.Namespace(**(base | overrides))


def sample(reward=None, status=Status.COMPLETED, remove=False, tokens=(1, 2, 3), response_length=1, **kw):
    return Sample(
        tokens=list(tokens),
        response_length=response_length,
        reward=reward,
        status=status,
        remove_sample=remove,
        **kw,
    )


# ------------------------------------------------------------------------------------------- shape_rewards
def test_grpo_normalises_each_group_by_mean_and_unbiased_std():
    groups = [[sample(1.0), sample(0.0), sample(0.0), sample(1.0)], [sample(2.0), sample(2.0)]]
    shaped = shape_rewards(make_args(), groups)
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735; group 2: equal rewards -> 0 / (0 + eps) = 0
    z = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert shaped == pytest.approx([z, -z, -z, z, 0.0, 0.0])
    raw = shape_rewards(make_args(rewards_normalization=False), groups)  # --disable-rewards-normalization
    assert raw == [s.reward_value() for g in groups for s in g]


def test_failed_samples_get_zero_and_leave_the_statistics_removed_ones_stay_in_them():
    groups = [[sample(1.0), sample(0.0), sample(None, status=Status.FAILED), sample(1.0)]]
    shaped = shape_rewards(make_args(), groups)
    # rewarded samples 1, 0, 1: mean 2/3, unbiased std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3)
    std = math.sqrt(1 / 3) + 1e-6
    assert shaped == pytest.approx([(1 / 3) / std, (-2 / 3) / std, 0.0, (1 / 3) / std])
    # as slime: remove_sample (e.g. set by --rollout-sample-filter-path) drops the loss, not the baseline
    groups[0].append(sample(5.0, remove=True))
    shaped = shape_rewards(make_args(), groups)
    mean, std = 7 / 4, math.sqrt(((1 - 7 / 4) ** 2 * 2 + (7 / 4) ** 2 + (5 - 7 / 4) ** 2) / 3) + 1e-6
    assert shaped == pytest.approx([(1 - mean) / std, -mean / std, 0.0, (1 - mean) / std, (5 - mean) / std])


def test_custom_reward_post_process_replaces_the_shaping(tmp_path, monkeypatch):
    (tmp_path / "post_hooks.py").write_text(
        "def post(args, samples):\n"
        "    raw = [s.reward_value() for s in samples]\n"
        "    return raw, [10 * r for r in raw]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    groups = [[sample(1.0), sample(0.0)], [sample(0.5), sample(0.25)]]
    args = make_args(custom_reward_post_process_path="post_hooks.post")
    assert shape_rewards(args, groups) == [10.0, 0.0, 5.0, 2.5]


def test_group_with_one_trainable_sample_has_no_baseline():
    groups = [[sample(1.0), sample(None, status=Status.FAILED)]]
    assert shape_rewards(make_args(), groups) == [0.0, 0.0]
    assert shape_rewards(make_args(advantage_estimator="reinforce_plus_plus_baseline"), groups) == [0.0, 0.0]


@pytest.mark.parametrize(
    "estimator, disable_std, expected",
    [
        ("grpo", True, [0.5, -1.0, 0.5]),  # mean 1.5, no std
        ("gspo", True, [0.5, -1.0, 0.5]),
        ("reinforce_plus_plus_baseline", False, [0.5, -1.0, 0.5]),  # never std-normalised
        ("ppo", False, [2.0, 0.5, 2.0]),  # raw
        ("reinforce_plus_plus", False, [2.0, 0.5, 2.0]),
    ],
)
def test_shaping_per_estimator(estimator, disable_std, expected):
    groups = [[sample(2.0), sample(0.5), sample(2.0)]]
    args = make_args(advantage_estimator=estimator, grpo_std_normalization=not disable_std)
    assert shape_rewards(args, groups) == pytest.approx(expected)


def test_raw_estimators_zero_failed_samples_and_read_dict_rewards():
    groups = [[sample({"acc": 1.0, "len": 3.0}), sample(None, status=Status.FAILED)]]
    assert shape_rewards(make_args(advantage_estimator="ppo", reward_key="acc"), groups) == [1.0, 0.0]


def test_loss_mask_of():
    assert loss_mask_of(sample(tokens=(1, 2, 3, 4), response_length=3)).tolist() == [1, 1, 1]
    assert loss_mask_of(sample(tokens=(1, 2, 3), response_length=2, loss_mask=[1, 0])).tolist() == [1, 0]
    assert loss_mask_of(sample(tokens=(1, 2, 3), response_length=2, remove=True)).tolist() == [0, 0]
    assert loss_mask_of(sample(tokens=(1, 2, 3), response_length=2, status=Status.FAILED)).tolist() == [0, 0]
    with pytest.raises(ValueError, match="loss_mask"):
        loss_mask_of(sample(tokens=(1, 2, 3), response_length=2, loss_mask=[1]))


# -------------------------------------------------------------------------------------------- partitions
def test_balanced_partitions_equal_size_complete_and_balanced():
    lengths = [100, 1, 50, 50, 3, 97, 20, 30]
    parts = balanced_partitions(lengths, 2, equal_size=True)
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert [len(p) for p in parts] == [4, 4]
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= 10, loads  # total 351: a 175/176-ish split
    with pytest.raises(ValueError):
        balanced_partitions([1, 2, 3], 2, equal_size=True)


def test_split_rollout_keeps_each_step_global_batch_together():
    lengths = [5, 9, 2, 7, 3, 3, 8, 1, 4, 6, 6, 2]
    ranks = split_rollout(lengths, dp_size=2, global_batch_size=4)  # 3 steps of 4, 2 per rank per step
    assert sorted(i for r in ranks for i in r) == list(range(12))
    assert [len(r) for r in ranks] == [6, 6]
    for step in range(3):
        step_indices = sorted(ranks[0][2 * step : 2 * step + 2] + ranks[1][2 * step : 2 * step + 2])
        assert step_indices == list(range(4 * step, 4 * step + 4))
    # step 0 lengths 5, 9, 2, 7: the balanced split pairs 9+2 against 7+5
    assert sorted(sum(lengths[i] for i in r[:2]) for r in ranks) == [11, 12]
    with pytest.raises(ValueError, match="global-batch-size"):
        split_rollout(lengths, dp_size=2, global_batch_size=5)


# ------------------------------------------------------------------------------------------ micro-batches
def test_fixed_micro_batches():
    assert fixed_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize(
    "lengths, max_tokens",
    [
        ([5, 5, 4, 3, 3], 10),  # the balanced greedy split into 2 overflows (5+3+3); the fallback must not
        ([7, 1, 8, 2, 6, 3, 9, 4], 12),
        ([30, 2, 3], 10),  # 30 does not fit anywhere: alone
    ],
)
def test_dynamic_micro_batches_respect_the_token_budget(lengths, max_tokens):
    need = min_micro_batches(lengths, max_tokens)
    for count in range(need, len(lengths) + 1):
        batches = dynamic_micro_batches(lengths, max_tokens, count)
        assert len(batches) == count
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:
            assert b and (len(b) == 1 or sum(lengths[i] for i in b) <= max_tokens), (count, batches)
    with pytest.raises(ValueError):
        dynamic_micro_batches(lengths, max_tokens, need - 1)


def test_min_micro_batches():
    assert min_micro_batches([5, 5, 4, 3, 3], 10) == 2
    assert min_micro_batches([30, 2, 3], 10) == 2


# ------------------------------------------------------------------------------------------------- packing
def test_pack_samples_positions_and_response_spans():
    samples = [
        sample(tokens=(10, 11, 12), response_length=1),
        sample(tokens=(20, 21, 22, 23), response_length=3),
        sample(tokens=(30, 31), response_length=0),
    ]
    packed = pack_samples(samples)
    assert packed.input_ids.tolist() == [10, 11, 12, 20, 21, 22, 23, 30, 31]
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1]
    assert packed.total_lengths == [3, 4, 2] and packed.response_lengths == [1, 3, 0]
    assert packed.response_spans() == [(2, 3), (4, 7), (9, 9)]
    index = packed.logit_indices()
    assert index.tolist() == [1, 3, 4, 5]
    assert packed.input_ids[index + 1].tolist() == [12, 21, 22, 23]  # exactly the response tokens
    with pytest.raises(ValueError, match="no prompt token"):
        pack_samples([sample(tokens=(1, 2), response_length=2)])


# --------------------------------------------------------------------------------------------- advantages
def test_grpo_advantages_broadcast_the_shaped_reward():
    masks = [torch.ones(2), torch.tensor([1.0, 0.0, 1.0])]
    adv, ret = compute_advantages_and_returns(make_args(), [0.5, -1.0], masks, None, None, None)
    assert [a.tolist() for a in adv] == [[0.5, 0.5], [-1.0, -1.0, -1.0]]
    assert ret is adv


def test_reinforce_plus_plus_uses_the_kl_penalty():
    args = make_args(advantage_estimator="reinforce_plus_plus", kl_coef=0.1, gamma=1.0)
    log_probs, ref = [torch.tensor([-1.0, -2.0])], [torch.tensor([-1.5, -1.0])]
    adv, _ = compute_advantages_and_returns(args, [1.0], [torch.ones(2)], log_probs, ref, None)
    # d = [0.5, -1.0]; token rewards [-0.05, 0.1 + 1]; returns [1.05, 1.1]
    torch.testing.assert_close(adv[0], torch.tensor([1.05, 1.1]))


def test_ppo_needs_values_and_uses_gae():
    args = make_args(advantage_estimator="ppo", gamma=1.0, lambd=1.0)
    with pytest.raises(ValueError, match="critic"):
        compute_advantages_and_returns(args, [1.0], [torch.ones(2)], None, None, None)
    values = [torch.tensor([0.25, 0.5])]
    adv, ret = compute_advantages_and_returns(args, [1.0], [torch.ones(2)], None, None, values)
    expected_adv, expected_ret = ppo_utils.get_advantages_and_returns(
        values[0], torch.tensor([0.0, 1.0]), torch.ones(2), 1.0, 1.0
    )
    torch.testing.assert_close(adv[0], expected_adv)
    torch.testing.assert_close(ret[0], expected_ret)
    torch.testing.assert_close(adv[0], torch.tensor([0.75, 0.5]))  # returns 1 everywhere minus V


def test_advantage_time_steps_all_counts_masked_tokens_as_steps_as_slime():
    # a tool output in the middle: mask [1, 0, 1], reward 2, γ 0.5, no KL
    masks = [torch.tensor([1.0, 0.0, 1.0])]
    rf = make_args(advantage_estimator="reinforce_plus_plus", kl_coef=0.0, gamma=0.5)
    (ours,), _ = compute_advantages_and_returns(rf, [2.0], masks, None, None, None)
    torch.testing.assert_close(ours, torch.tensor([1.0, 0.0, 2.0]))  # the tool token is no step
    rf.advantage_time_steps = "all"
    (slimes,), _ = compute_advantages_and_returns(rf, [2.0], masks, None, None, None)
    torch.testing.assert_close(slimes, torch.tensor([0.5, 1.0, 2.0]))  # it is one (reward 0)
    # ppo, γ = λ = 1: every token is a GAE step, the reward on the last; A_t = 2 − V_t (V past the end 0)
    values = [torch.tensor([0.5, 9.0, 0.25])]
    ppo = make_args(advantage_estimator="ppo", gamma=1.0, lambd=1.0, advantage_time_steps="all")
    (adv,), (ret,) = compute_advantages_and_returns(ppo, [2.0], masks, None, None, values)
    torch.testing.assert_close(adv, torch.tensor([1.5, -7.0, 1.75]))
    torch.testing.assert_close(ret, torch.tensor([2.0, 2.0, 2.0]))
    ppo.advantage_time_steps = "loss_mask"  # the tool token's value (9) takes no part
    (adv,), _ = compute_advantages_and_returns(ppo, [2.0], masks, None, None, values)
    torch.testing.assert_close(adv, torch.tensor([1.5, 0.0, 1.75]))
