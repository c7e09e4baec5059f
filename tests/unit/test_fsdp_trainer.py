"""FSDPTrainer in one process (world size 1, gloo on CPU, fp32): log-probs, the loss, invariances, checkpoints,
HF export and weight buckets. The two-rank versions live in tests/e2e/test_fsdp_distributed.py."""

from __future__ import annotations

import argparse
import copy
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from vime.backends.fsdp_utils.trainer import FSDPTrainer
from vime.backends.policy_inputs import policy_inputs
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils import ppo_utils
from vime.utils.arguments import parse_args
from vime.utils.checkpoint_layout import latest_iteration
from vime.utils.train_data import loss_mask_of, normalize_advantages, shape_rewards
from vime.utils.types import Sample, Status

# (prompt length, response length) of 8 samples = 2 groups of 4
SHAPES = [(3, 2), (5, 7), (1, 4), (8, 1), (2, 9), (4, 4), (6, 3), (2, 2)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("fsdp") / "model", seed=0, task=None)


@pytest.fixture(scope="module")
def base_args(model_dir) -> argparse.Namespace:
    return parse_args(
        [
            "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-rollout", "4",
            "--lr", "1e-3", "--weight-decay", "0", "--micro-batch-size", "2",
        ]
    )  # fmt: skip


def with_args(base: argparse.Namespace, **overrides) -> argparse.Namespace:
    args = copy.deepcopy(base)
    vars(args).update(overrides)
    return args


def make_samples(seed: int = 0, rewards=(1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0)) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, ((p, r), reward) in enumerate(zip(SHAPES, rewards, strict=True)):
        tokens = torch.randint(4, 61, (p + r,), generator=g).tolist()
        rollout_lp = (-torch.rand(r, generator=g)).tolist()
        samples.append(
            Sample(index=i, tokens=tokens, response_length=r, reward=reward, status=Status.COMPLETED,
                   rollout_log_probs=rollout_lp)
        )  # fmt: skip
    return samples


def groups_of(samples: list[Sample]) -> list[list[Sample]]:
    return [samples[:4], samples[4:]]


def full_params(trainer: FSDPTrainer) -> dict[str, torch.Tensor]:
    return {name: t.cpu().clone() for bucket in trainer.iter_weight_buckets(1 << 30) for name, t in bucket}


def hf_log_probs(model, s: Sample, temperature: float = 1.0) -> torch.Tensor:
    logits = model(torch.tensor([s.tokens])).logits[0].float() / temperature
    positions = torch.arange(s.prompt_length - 1, len(s.tokens) - 1)
    return torch.log_softmax(logits, -1)[positions, torch.tensor(s.tokens[s.prompt_length :])]


def assert_same_params(a: dict, b: dict, rtol: float = 0.0, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(
            a[name], b[name], rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )


# ------------------------------------------------------------------------------------------------ log-probs
def test_packed_log_probs_equal_a_plain_transformers_forward(base_args, model_dir):
    args = with_args(
        base_args, micro_batch_size=8, rollout_temperature=0.7
    )  # all 8 samples in one packed row
    trainer = FSDPTrainer(args)
    samples = make_samples()
    got = trainer.compute_log_probs(samples)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for s, lp in zip(samples, got, strict=True):
            assert lp.shape == (s.response_length,)
            torch.testing.assert_close(lp, hf_log_probs(reference, s, 0.7), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------- the loss
def test_all_zero_advantages_leave_the_parameters_unchanged(base_args):
    args = with_args(base_args, lr=1e-2)
    trainer = FSDPTrainer(args)
    samples = make_samples(rewards=(1.0,) * 4 + (0.0,) * 4)  # equal rewards within each group
    rewards = shape_rewards(args, groups_of(samples))
    assert rewards == [0.0] * 8
    before = full_params(trainer)
    metrics = trainer.train(0, samples, rewards)
    assert metrics["grad_norm"] == 0.0 and metrics["lr"] == 1e-2
    for name, tensor in full_params(trainer).items():
        assert torch.equal(tensor, before[name]), name


def test_training_raises_the_log_probs_of_positive_advantage_samples(base_args):
    args = with_args(base_args, lr=1e-2)
    trainer = FSDPTrainer(args)
    samples = make_samples()
    rewards = shape_rewards(args, groups_of(samples))
    before = trainer.compute_log_probs(samples)
    for k in range(3):  # three updates on the same batch
        trainer.train(k, samples, rewards)
    after = trainer.compute_log_probs(samples)
    # the policy-gradient objective sum(A * mean log-prob) rises, and each sample moves the way its advantage says
    gains = [r * (a.mean() - b.mean()).item() for r, a, b in zip(rewards, after, before, strict=True)]
    assert sum(gains) > 0.1
    assert all(g > 0 for g in gains), gains


def test_micro_batching_does_not_change_the_update(base_args):
    # Two optimizer steps per rollout (4 samples each), per-sample-mean and per-token loss. SGD, because Adam's
    # first step is ~lr * sign(grad): it would turn fp32 rounding noise in near-zero gradients into lr-sized
    # differences, while SGD shows the gradients themselves agree.
    results = {}
    for per_token in (False, True):
        for name, overrides in {
            "mbs1": dict(micro_batch_size=1),
            "mbs4": dict(micro_batch_size=4),
            "dynamic": dict(use_dynamic_batch_size=True, max_tokens_per_gpu=12),
        }.items():
            args = with_args(
                base_args,
                optimizer="sgd",
                lr=0.1,
                global_batch_size=4,
                num_steps_per_rollout=2,
                calculate_per_token_loss=per_token,
                **overrides,
            )
            trainer = FSDPTrainer(args)
            samples = make_samples()
            metrics = trainer.train(0, samples, shape_rewards(args, groups_of(samples)))
            results[per_token, name] = (full_params(trainer), metrics)
        reference, ref_metrics = results[per_token, "mbs1"]
        for name in ("mbs4", "dynamic"):
            params, metrics = results[per_token, name]
            assert_same_params(reference, params, rtol=1e-6, atol=1e-8)  # fp32 rounding of the sums
            assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)
            assert metrics["entropy"] == pytest.approx(ref_metrics["entropy"], rel=1e-5)
    moved = max((results[False, "mbs1"][0][k] - results[True, "mbs1"][0][k]).abs().max() for k in reference)
    assert moved > 1e-4  # the two reductions are different losses, so the test can tell them apart


def test_samples_of_one_trajectory_share_one_loss_denominator(base_args):
    # slime's rollout_id: samples 0-1 and 4-6 are two trajectories, the rest their own; on-policy (ratio 1) each
    # token's loss is -A, so the loss is minus the mean over the 5 trajectories of their token-weighted mean of A
    rollout_ids = [100, 100, None, None, 200, 200, 200, None]
    results = {}
    for name, overrides in {"mbs1": dict(micro_batch_size=1), "mbs4": dict(micro_batch_size=4)}.items():
        args = with_args(base_args, optimizer="sgd", lr=0.1, **overrides)
        trainer = FSDPTrainer(args)
        samples = make_samples()
        for sample, rollout_id in zip(samples, rollout_ids, strict=True):
            sample.rollout_id = rollout_id
        rewards = shape_rewards(args, groups_of(samples))
        results[name] = (full_params(trainer), trainer.train(0, samples, rewards))
    lengths = [r for _, r in SHAPES]
    trajectories = {}
    for i, rollout_id in enumerate(rollout_ids):
        key = rollout_id if rollout_id is not None else f"sample{i}"
        total, tokens = trajectories.get(key, (0.0, 0))
        trajectories[key] = (total + rewards[i] * lengths[i], tokens + lengths[i])
    expected = -sum(total / tokens for total, tokens in trajectories.values()) / len(trajectories)
    per_sample = -sum(rewards) / len(rewards)
    assert abs(expected - per_sample) > 0.05  # the two reductions differ on this batch
    for _, metrics in results.values():
        assert metrics["pg_loss"] == pytest.approx(expected, rel=1e-5)
    assert_same_params(results["mbs1"][0], results["mbs4"][0], rtol=1e-6, atol=1e-8)


# ------------------------------------------------------------------------------------------- checkpoints
def test_resume_continues_bit_for_bit(base_args, tmp_path):
    args = with_args(
        base_args, lr_decay_style="cosine", lr_warmup_iters=1, min_lr=1e-4, use_kl_loss=True, kl_loss_coef=0.1,
        save=str(tmp_path / "ckpt"), load=str(tmp_path / "ckpt"),
    )  # fmt: skip
    samples = make_samples()
    rewards = shape_rewards(args, groups_of(samples))
    first = FSDPTrainer(args)
    assert first.load() is None  # empty --load: start from --hf-checkpoint
    first.train(0, samples, rewards)
    first.save(0, args.save)
    expected_rng = (torch.rand(3), random.random(), np.random.rand())
    after_save = full_params(first)
    first_metrics = first.train(1, samples, rewards)
    uninterrupted = full_params(first)

    resumed = FSDPTrainer(args)
    assert resumed.load() == 0
    assert (torch.rand(3), random.random(), np.random.rand())[1:] == expected_rng[1:]
    assert resumed.step == 1
    assert_same_params(after_save, full_params(resumed), atol=0)
    resumed_metrics = resumed.train(1, samples, rewards)
    assert resumed_metrics["lr"] == first_metrics["lr"]
    assert_same_params(uninterrupted, full_params(resumed), atol=0)
    assert (Path(args.save) / "latest_checkpointed_iteration.txt").read_text() == "0"


def test_empty_load_falls_back_to_ref_load(base_args, tmp_path):
    trained = FSDPTrainer(base_args)
    samples = make_samples()
    trained.train(0, samples, shape_rewards(base_args, groups_of(samples)))
    trained.save(0, str(tmp_path / "ckpt"))
    trained.export_hf(str(tmp_path / "hf"))
    expected = full_params(trained)
    for ref_load in ("ckpt", "hf"):  # a vime checkpoint or an HF directory
        args = with_args(
            base_args, load=str(tmp_path / "empty"), ref_load=str(tmp_path / ref_load), use_kl_loss=True
        )
        trainer = FSDPTrainer(args)
        assert trainer.load() is None
        assert_same_params(expected, full_params(trainer))
        policy, reference = trainer.compute_log_probs(samples), trainer.compute_log_probs(samples, "ref")
        assert all(torch.equal(a, b) for a, b in zip(policy, reference, strict=True))


def test_export_hf_and_weight_buckets(base_args, model_dir, tmp_path):
    trainer = FSDPTrainer(base_args)
    samples = make_samples()
    trainer.train(0, samples, shape_rewards(base_args, groups_of(samples)))
    out = tmp_path / "hf"
    trainer.export_hf(str(out))
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(out).encode("12+3=") == AutoTokenizer.from_pretrained(
        model_dir
    ).encode("12+3=")
    weights = full_params(trainer)
    for name, tensor in exported.state_dict().items():
        key = name if name in weights else "model.embed_tokens.weight"  # a tied lm_head is exported once
        assert torch.equal(tensor, weights[key]), name

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        hf_shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    limit = 40_000  # bytes; the 61x128 fp32 embedding (31 KB) fits, two of the 128x256 MLP weights do not
    buckets = list(trainer.iter_weight_buckets(limit))
    names = [name for bucket in buckets for name, _ in bucket]
    assert sorted(names) == sorted(hf_shapes) and len(names) == len(set(names))
    for bucket in buckets:
        assert len(bucket) == 1 or sum(t.numel() * t.element_size() for _, t in bucket) <= limit
        for name, tensor in bucket:
            assert tuple(tensor.shape) == hf_shapes[name]
    assert len(buckets) > 1


# ------------------------------------------------------------------------------------------ other paths
def test_kl_loss_reference_model_and_rollout_metrics(base_args):
    args = with_args(
        base_args, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k3", use_tis=True, lr=1e-2,
        get_mismatch_metrics=True,
    )  # fmt: skip
    trainer = FSDPTrainer(args)
    samples = make_samples()
    rewards = shape_rewards(args, groups_of(samples))
    old = trainer.compute_log_probs(samples)
    diffs = [(lp - torch.tensor(s.rollout_log_probs)).abs() for s, lp in zip(samples, old, strict=True)]
    first = trainer.train(0, samples, rewards)
    assert first["train_rollout_logprob_abs_diff"] == pytest.approx(
        sum(d.sum().item() for d in diffs) / sum(d.numel() for d in diffs), rel=1e-6
    )
    assert first["kl_loss"] == 0.0  # the policy is still the reference
    # --get-mismatch-metrics: the same |train - rollout| over the same tokens, and consistent ratio statistics
    assert first["mismatch/abs_diff"] == pytest.approx(first["train_rollout_logprob_abs_diff"], rel=1e-6)
    assert first["mismatch/ratio_min"] <= first["mismatch/ratio"] <= first["mismatch/ratio_max"]
    assert first["mismatch/k3"] >= 0.0
    assert 0.0 <= first["tis_clipfrac"] <= 1.0 and first["tis"] > 0 and first["ois"] == pytest.approx(1.0)
    second = trainer.train(1, samples, rewards)
    assert second["kl_loss"] > 0.0
    reference = trainer.compute_log_probs(samples, model="ref")
    assert all(torch.equal(a, b) for a, b in zip(reference, old, strict=True))  # the reference stays frozen


def test_untrainable_samples_do_not_affect_the_update(base_args):
    # FAILED and remove_sample samples keep their place in the batch, but their tokens and rewards do not matter
    args = with_args(base_args, lr=1e-2)
    updated = []
    for seed in (0, 1):  # same lengths, different tokens and rewards in the untrainable samples
        samples = make_samples(seed=seed)
        for s in samples[:3]:
            s.remove_sample = True
        samples[3].mark_failed("reward timeout")
        kept = make_samples(seed=0)[4:]
        samples[4:] = kept
        rewards = shape_rewards(args, groups_of(samples))
        assert rewards[3] == 0.0  # FAILED: no reward (removed samples keep a baseline-shaped one, as slime)
        rewards[:4] = [3.0 - 6.0 * seed] * 4  # even a non-zero reward must not move the policy through them
        trainer = FSDPTrainer(args)
        metrics = trainer.train(0, samples, rewards)
        assert metrics["grad_norm"] > 0
        updated.append(full_params(trainer))
    assert_same_params(updated[0], updated[1], atol=0)


def test_critic_learns_the_returns(base_args):
    args = with_args(base_args, advantage_estimator="ppo", critic_lr=1e-3, value_clip=None)
    critic = FSDPTrainer(args, role="critic")
    samples = make_samples()
    rewards = shape_rewards(args, groups_of(samples))
    values = critic.compute_values(samples)
    assert [v.shape[0] for v in values] == [s.response_length for s in samples]
    losses = [critic.train(k, samples, rewards)["value_loss"] for k in range(4)]
    assert losses[-1] < 0.5 * losses[0]

    actor = FSDPTrainer(args)
    with pytest.raises(ValueError, match="critic"):
        actor.train(0, samples, rewards)
    metrics = actor.train(0, samples, rewards, values=critic.compute_values(samples))
    assert metrics["grad_norm"] > 0


def custom_advantages(args, samples, rewards, log_probs, ref_log_probs, values):
    """Test hook: advantage +1 on every token of the first sample, 0 elsewhere."""
    return [torch.full((s.response_length,), float(i == 0)) for i, s in enumerate(samples)]


def custom_loss(args, batch, log_probs, entropy):
    """Test hook: the default loss with the reduction helper, plus a metric."""
    pg_losses, _ = ppo_utils.compute_policy_loss(
        batch["old_log_probs"] - log_probs, batch["advantages"], args.eps_clip, args.eps_clip_high
    )
    loss = batch["reduce"](pg_losses)
    return loss, {"loss": loss.detach(), "custom_metric": batch["reduce"](torch.ones_like(log_probs))}


def test_custom_loss_and_advantage_hooks(base_args):
    args = with_args(
        base_args,
        lr=1e-2,
        custom_loss_function_path="test_fsdp_trainer.custom_loss",
        custom_advantage_function_path="test_fsdp_trainer.custom_advantages",
    )
    trainer = FSDPTrainer(args)
    samples = make_samples()
    before = trainer.compute_log_probs(samples)
    metrics = trainer.train(0, samples, [0.0] * 8)
    assert metrics["custom_metric"] == pytest.approx(1.0)  # the per-sample mean of ones over the global batch
    after = trainer.compute_log_probs(samples)
    assert after[0].mean() > before[0].mean()


def slime_custom_loss(args, batch, logits, sum_of_sample_mean):
    """A policy-gradient loss written for slime's signature, with slime's helper (imported from vime)."""
    from vime.utils.loss import get_log_probs_and_entropy

    out = get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"], with_entropy=True,
    )  # fmt: skip
    log_probs = torch.cat(out["log_probs"])
    pg_losses, _ = ppo_utils.compute_policy_loss(
        torch.cat(batch["log_probs"]) - log_probs,
        torch.cat(batch["advantages"]),
        args.eps_clip,
        args.eps_clip_high,
    )
    loss = sum_of_sample_mean(pg_losses)
    return loss, {"loss": loss.detach(), "entropy": sum_of_sample_mean(torch.cat(out["entropy"])).detach()}


def test_a_custom_loss_with_slimes_signature_trains_like_ours(base_args):
    params, metrics = {}, {}
    for name in ("custom_loss", "slime_custom_loss"):
        args = with_args(base_args, lr=1e-2, custom_loss_function_path=f"test_fsdp_trainer.{name}")
        trainer = FSDPTrainer(args)
        samples = make_samples()
        metrics[name] = trainer.train(0, samples, shape_rewards(args, groups_of(samples)))
        params[name] = full_params(trainer)
    assert_same_params(params["custom_loss"], params["slime_custom_loss"], rtol=1e-5, atol=1e-7)
    assert metrics["slime_custom_loss"]["entropy"] > 0


SLIME_KEYS_SEEN: list[set[str]] = []


def slime_advantages(args, rollout_data):
    """Test hook with slime's contract: the same advantages as :func:`custom_advantages`, set in place."""
    SLIME_KEYS_SEEN.append(set(rollout_data))
    lengths = rollout_data["response_lengths"]
    rollout_data["advantages"] = [torch.full((n,), float(i == 0)) for i, n in enumerate(lengths)]
    rollout_data["returns"] = rollout_data["advantages"]


def test_a_custom_advantage_function_with_slimes_contract_trains_like_ours(base_args):
    params = {}
    for path in ("test_fsdp_trainer.custom_advantages", "test_fsdp_trainer.slime_advantages"):
        trainer = FSDPTrainer(with_args(base_args, lr=1e-2, custom_advantage_function_path=path))
        trainer.train(0, make_samples(), [0.0] * 8)
        params[path] = full_params(trainer)
    assert_same_params(*params.values())
    assert SLIME_KEYS_SEEN[-1] >= {
        "log_probs", "ref_log_probs", "rewards", "values", "response_lengths", "total_lengths", "loss_masks",
        "rollout_log_probs", "kl",
    }  # fmt: skip
    moved = FSDPTrainer(with_args(base_args, lr=1e-2))
    moved.train(0, make_samples(), [0.0] * 8)  # zero advantages: no step
    assert max((full_params(moved)[k] - v).abs().max() for k, v in params[path].items()) > 0


def test_normalize_advantages_single_rank_matches_masked_whiten():
    advantages = [torch.tensor([1.0, 2.0]), torch.tensor([0.0, 5.0, -1.0])]
    masks = [torch.ones(2), torch.tensor([1.0, 0.0, 1.0])]
    got = normalize_advantages(advantages, masks)
    expected = ppo_utils.masked_whiten(torch.cat(advantages), torch.cat(masks)) * torch.cat(masks)
    torch.testing.assert_close(torch.cat(got), expected)


def test_on_policy_distillation_pulls_the_student_towards_the_teacher(base_args, tmp_path):
    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=1, task=None)
    args = with_args(base_args, lr=1e-3, use_opd=True, opd_type="trainer", opd_teacher_load=str(teacher_dir))
    trainer = FSDPTrainer(args)
    samples = make_samples(
        rewards=(1.0,) * 4 + (0.0,) * 4
    )  # zero advantages: only the OPD term moves the policy
    rewards = shape_rewards(args, groups_of(samples))
    teacher = trainer.compute_log_probs(samples, model="teacher")
    before = trainer.compute_log_probs(samples)
    trainer.train(0, samples, rewards)
    after = trainer.compute_log_probs(samples)
    # The OPD advantage is logp_teacher - logp_student: a small step raises the student's log-prob where the
    # teacher's is higher and lowers it where it is lower, so this first-order surrogate must increase.
    surrogate = sum(((t - b) * (a - b)).sum().item() for t, b, a in zip(teacher, before, after, strict=True))
    moved = sum((a - b).abs().sum().item() for b, a in zip(before, after, strict=True))
    assert moved > 1e-3 and surrogate > 0, (moved, surrogate)


def test_a_distributed_backend_other_than_the_machines_is_refused(base_args):
    import copy

    from vime.utils.distributed import init_distributed

    args = copy.copy(base_args)
    args.distributed_backend = "nccl"  # this CPU machine uses gloo
    with pytest.raises(ValueError, match="--distributed-backend nccl: vime uses gloo here"):
        init_distributed(args.distributed_timeout_minutes, args.distributed_backend)


def test_reset_optimizer_states_restarts_adams_step_count(base_args, tmp_path):
    args = with_args(base_args, save=str(tmp_path / "ckpt"), load=str(tmp_path / "ckpt"))
    samples = make_samples()
    rewards = shape_rewards(args, groups_of(samples))
    first = FSDPTrainer(args)
    first.train(0, samples, rewards)
    first.save(0, args.save)
    steps = [float(s["step"]) for s in first.optimizer.state.values()]
    assert steps and all(step == 1 for step in steps)
    reset = FSDPTrainer(with_args(args, reset_optimizer_states=True))
    assert reset.load() == 0
    assert all(float(s["step"]) == 0 for s in reset.optimizer.state.values())
    moments = [s["exp_avg"] for s in reset.optimizer.state.values()]
    assert any(float(m.full_tensor().abs().sum()) > 0 for m in moments)  # the moments are kept


def test_ref_update_interval_copies_the_policy_into_the_reference(base_args):
    args = with_args(base_args, use_kl_loss=True, kl_loss_coef=0.1, lr=1e-2, ref_update_interval=2)
    samples = make_samples()
    rewards = shape_rewards(args, groups_of(samples))
    trainer = FSDPTrainer(args)

    def full(p):
        return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()

    initial = {n: full(p).clone() for n, p in trainer.ref_model.named_parameters()}

    def ref_equals_policy() -> bool:
        policy = dict(trainer.model.named_parameters())
        return all(torch.equal(full(p), full(policy[n])) for n, p in trainer.ref_model.named_parameters())

    trainer.train(0, samples, rewards)  # rollout 0: not yet (every 2 rollouts)
    assert not ref_equals_policy()
    assert all(torch.equal(full(p), initial[n]) for n, p in trainer.ref_model.named_parameters())
    trainer.train(1, samples, rewards)
    assert ref_equals_policy()


@pytest.mark.parametrize(
    ("flags", "trained"),
    [
        (dict(freeze_params_name_list=["embed_tokens", r"layers\.0\."]), lambda n: "embed" not in n and ".0." not in n),
        (dict(only_train_params_name_list=["lm_head"]), lambda n: "lm_head" in n),
    ],
)  # fmt: skip
def test_freeze_and_only_train_param_lists(base_args, flags, trained):
    args = with_args(base_args, **flags)
    trainer = FSDPTrainer(args)
    before = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}
    samples = make_samples()
    trainer.train(0, samples, shape_rewards(args, groups_of(samples)))
    after = {n: p.full_tensor() for n, p in trainer.model.named_parameters()}
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(trained(n) for n in changed), sorted(changed)
    assert all(not trained(n) or n in changed or before[n].ndim <= 1 for n in before)


def test_a_freeze_pattern_that_matches_nothing_is_an_error(base_args):
    with pytest.raises(ValueError, match="--freeze-params-name-list 'embeding' matches no parameter"):
        FSDPTrainer(with_args(base_args, freeze_params_name_list=["embeding"]))


def test_ref_ckpt_step_picks_the_reference_iteration(base_args, tmp_path):
    trainer = FSDPTrainer(base_args)
    samples = make_samples()
    rewards = shape_rewards(base_args, groups_of(samples))
    trainer.train(0, samples, rewards)
    trainer.save(0, str(tmp_path / "ckpt"))
    at_0 = trainer.compute_log_probs(samples)
    trainer.train(1, samples, rewards)
    trainer.save(1, str(tmp_path / "ckpt"))  # the latest
    for step, want in ((0, at_0), (None, trainer.compute_log_probs(samples))):
        args = with_args(base_args, ref_load=str(tmp_path / "ckpt"), ref_ckpt_step=step, use_kl_loss=True)
        reference = FSDPTrainer(args).compute_log_probs(samples, "ref")
        assert all(torch.equal(a, b) for a, b in zip(reference, want, strict=True)), step
    # written but not yet declared complete (Run.save writes the data buffer in between): --load still finds 1
    trainer.save(2, str(tmp_path / "ckpt"), mark=False)
    assert (tmp_path / "ckpt" / "iter_0000002").is_dir() and latest_iteration(str(tmp_path / "ckpt")) == 1
    trainer.mark_saved(2, str(tmp_path / "ckpt"))
    assert latest_iteration(str(tmp_path / "ckpt")) == 2


def _opd_samples() -> list[Sample]:
    return [
        Sample(index=0, tokens=[5, 6, 7, 8], response_length=2, reward=0.0, status=Status.COMPLETED,
               rollout_log_probs=[-1.0, -2.0], teacher_log_probs=[-0.5, -3.0]),
        Sample(index=1, tokens=[5, 6, 7], response_length=2, reward=0.0, status=Status.COMPLETED,
               rollout_log_probs=[-2.0, -0.5], loss_mask=[1, 0], teacher_log_probs=[-1.0, -1.0]),
        Sample(index=2, tokens=[5, 6, 7], response_length=1, reward=0.0, status=Status.FAILED,
               rollout_log_probs=[-1.0]),  # its teacher call failed: no teacher log-probs, no loss
    ]  # fmt: skip


def test_opd_term_from_teacher_log_probs_on_the_samples_hand_worked(base_args):
    args = with_args(base_args, use_opd=True, opd_type="vllm", opd_kl_coef=0.5)
    trainer = FSDPTrainer(args)
    samples = _opd_samples()
    student = [torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -0.5]), torch.tensor([-1.0])]
    masks = [loss_mask_of(s) for s in samples]
    data, metrics = policy_inputs(trainer, samples, [0.0] * 3, masks, None, student, None)
    # zero rewards: A = -0.5 * (logp_student - logp_teacher) per token; the FAILED sample's term is 0
    expected = [[-0.5 * (-1.0 + 0.5), -0.5 * (-2.0 + 3.0)], [-0.5 * (-2.0 + 1.0), -0.5 * (-0.5 + 1.0)], [0.0]]
    for got, want in zip(data["advantages"], expected, strict=True):
        torch.testing.assert_close(got.cpu(), torch.tensor(want))
    # reverse KL averaged over the loss-masked tokens only: (-1 + 0.5) + (-2 + 3) + (-2 + 1), over 3 tokens
    assert metrics["opd_reverse_kl"] == pytest.approx((-0.5 + 1.0 - 1.0) / 3)


def test_opd_without_teacher_log_probs_names_the_reward_to_use(base_args):
    trainer = FSDPTrainer(with_args(base_args, use_opd=True, opd_type="vllm"))
    samples = _opd_samples()
    samples[1].teacher_log_probs = None
    student = [torch.zeros(s.response_length) for s in samples]
    with pytest.raises(ValueError, match="vime.rollout.on_policy_distillation.reward_func"):
        policy_inputs(trainer, samples, [0.0] * 3, [loss_mask_of(s) for s in samples], None, student, None)
    samples[1].teacher_log_probs = [-1.0]
    with pytest.raises(ValueError, match="len\\(teacher_log_probs\\)=1 != response_length=2"):
        policy_inputs(trainer, samples, [0.0] * 3, [loss_mask_of(s) for s in samples], None, student, None)


def test_teacher_log_probs_from_a_server_train_like_the_trainer_side_teacher(base_args, tmp_path):
    """--opd-type vllm with the teacher's log-probs on the samples makes the same update as --opd-type trainer
    with that teacher loaded in the trainer."""
    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=1, task=None)
    with_teacher = FSDPTrainer(
        with_args(base_args, use_opd=True, opd_type="trainer", opd_teacher_load=str(teacher_dir))
    )
    samples = make_samples(rewards=(1.0,) * 4 + (0.0,) * 4)
    rewards = shape_rewards(base_args, groups_of(samples))
    served = copy.deepcopy(samples)
    for s, t in zip(served, with_teacher.compute_log_probs(samples, model="teacher"), strict=True):
        s.teacher_log_probs = t.tolist()
    metrics_trainer = with_teacher.train(0, samples, rewards)
    from_server = FSDPTrainer(with_args(base_args, use_opd=True, opd_type="vllm"))
    assert from_server.teacher_model is None
    metrics_server = from_server.train(0, served, rewards)
    assert metrics_server["opd_reverse_kl"] == pytest.approx(metrics_trainer["opd_reverse_kl"], abs=1e-6)
    a, b = full_params(with_teacher), full_params(from_server)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


def test_memory_probe_runs_with_every_gradient_resident_and_clears_them(base_args):
    """The memory check's probe (CUDA-only in a run) counts the gradients FSDP2 creates in a step's first backward
    and holds them through its forward/backward, as a later micro-batch does; it leaves no gradient behind."""
    trainer = FSDPTrainer(base_args)
    before = full_params(trainer)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    assert trainer._probe_gradient_bytes() == sum(p.numel() * p.element_size() for p in params) > 0
    trainer._memory_probe(make_samples())
    assert all(p.grad is None for p in params)
    assert_same_params(full_params(trainer), before)


def test_score_centering_on_policy_trains_like_plain_reinforce(base_args, model_dir):
    # When the sampler is the trainer (its head: the trainer's own top-4 at the rollout temperature), q = p on the
    # head, so ρ = 1, α = 1 and the centering term is 0: one step updates exactly as --pg-loss-type reinforce. Heads
    # read from the wrong rows, or at the wrong temperature, would not cancel. SGD: see the micro-batching test.
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    samples = make_samples()
    with torch.no_grad():
        for s in samples:
            logits = reference(torch.tensor([s.tokens])).logits[0, s.prompt_length - 1 : -1].float() / 0.7
            head = torch.log_softmax(logits, -1).topk(4)
            s.rollout_topk_token_ids, s.rollout_topk_log_probs = head.indices.tolist(), head.values.tolist()
    updated = {}
    for centering in (False, True):
        args = with_args(base_args, optimizer="sgd", lr=0.1, rollout_temperature=0.7, pg_loss_type="reinforce",
                         use_score_centering=centering, score_centering_top_k=4)  # fmt: skip
        trainer = FSDPTrainer(args)
        metrics = trainer.train(0, samples, shape_rewards(args, groups_of(samples)))
        updated[centering] = full_params(trainer)
    assert abs(metrics["sc_correction"]) < 1e-6 and metrics["sc_sampler_head_mass"] > 0
    assert_same_params(updated[True], updated[False], atol=1e-6, rtol=1e-5)
