"""slime's trainer-side flags on the FSDP2 trainer in one process (CPU, gloo, fp32): --keep-old-actor,
--use-rollout-entropy, --rollout-data-postprocess-path, --use-stateless-adam, the --ci-* checks,
--save-debug-train-data, --log-probs-max-tokens-per-gpu, --balance-by-flops, --log-probs-chunk-size,
--recompute-loss-function and the --record-memory-history recorder."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vime.backends.fsdp_utils.log_probs import token_log_probs
from vime.backends.fsdp_utils.trainer import FSDPTrainer
from vime.backends.trainer_base import TrainerBase
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils.arguments import parse_args
from vime.utils.distributed import DataParallel, init_distributed
from vime.utils.flops import sequence_flops
from vime.utils.offload import local_shard
from vime.utils.train_data import shape_rewards
from vime.utils.train_debug import MemoryRecorder
from vime.utils.types import Sample, Status

SHAPES = [
    (3, 2),
    (5, 7),
    (1, 4),
    (8, 1),
    (2, 9),
    (4, 4),
    (6, 3),
    (2, 2),
]  # (prompt, response) of 2 groups of 4
REWARDS = (1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("slime_flags") / "model", seed=0, task=None)


@pytest.fixture(scope="module")
def base_args(model_dir) -> argparse.Namespace:
    return parse_args(
        [
            "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-rollout", "4",
            "--lr", "1e-2", "--weight-decay", "0", "--micro-batch-size", "4",
        ]
    )  # fmt: skip


def with_args(base: argparse.Namespace, **overrides) -> argparse.Namespace:
    args = copy.deepcopy(base)
    vars(args).update(overrides)
    return args


def make_samples(seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, ((p, r), reward) in enumerate(zip(SHAPES, REWARDS, strict=True)):
        tokens = torch.randint(4, 61, (p + r,), generator=g).tolist()
        samples.append(
            Sample(index=i, tokens=tokens, response_length=r, reward=reward, status=Status.COMPLETED,
                   rollout_log_probs=(-torch.rand(r, generator=g)).tolist())
        )  # fmt: skip
    return samples


def train(trainer: FSDPTrainer, rollout_id: int, samples: list[Sample], **kw) -> dict[str, float]:
    return trainer.train(rollout_id, samples, shape_rewards(trainer.args, [samples[:4], samples[4:]]), **kw)


def params(trainer: FSDPTrainer) -> dict[str, torch.Tensor]:
    return {name: local_shard(p).detach().clone() for name, p in trainer.model.named_parameters()}


def same(a: list[torch.Tensor], b: list[torch.Tensor], atol: float = 1e-6) -> bool:
    return all(torch.allclose(x, y, atol=atol, rtol=0) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------------------------------- --keep-old-actor
def test_keep_old_actor_scores_old_log_probs_with_the_weights_the_rollout_was_generated_with(base_args):
    """train_async.py: rollout k+1 is generated with the weights of the sync before the last one."""
    args = with_args(base_args, keep_old_actor=True, update_weights_interval=1)
    trainer, samples = FSDPTrainer(args), make_samples()
    v0 = trainer.compute_log_probs(samples)
    trainer.after_weight_sync()  # the first sync (engines get v0)
    assert same(trainer.compute_log_probs(samples, "old_actor"), v0)
    train(trainer, 0, samples)  # -> v1; the rollout being generated meanwhile still comes from v0
    v1 = trainer.compute_log_probs(samples)
    assert not same(v1, v0, atol=1e-4)
    trainer.after_weight_sync()  # engines get v1, rollout 1 was made with v0
    assert same(trainer.compute_log_probs(samples, "old_actor"), v0)
    metrics = train(trainer, 1, samples)  # the ratio is taken against v0, so the first step's ppo_kl is not 0
    assert abs(metrics["ppo_kl"]) > 1e-6
    trainer.after_weight_sync()
    assert same(trainer.compute_log_probs(samples, "old_actor"), v1)

    plain = FSDPTrainer(with_args(base_args, num_steps_per_rollout=1))
    train(plain, 0, samples)
    assert abs(train(plain, 1, samples)["ppo_kl"]) < 1e-8  # without it the old policy is the current one


def test_rollout_weights_loaded_holds_the_engines_version_and_gives_the_trained_weights_back(base_args):
    """A replacement pushed while the actor is a step ahead gets the version the rollout is generated with."""
    trainer, samples = (
        FSDPTrainer(with_args(base_args, keep_old_actor=True, update_weights_interval=1)),
        make_samples(),
    )
    with pytest.raises(RuntimeError, match="no weights kept"):
        with trainer.rollout_weights_loaded():
            pass
    v0 = trainer.compute_log_probs(samples)
    trainer.after_weight_sync()  # engines get v0
    train(trainer, 0, samples)  # -> v1, while the engines generate with v0
    v1, trained = trainer.compute_log_probs(samples), params(trainer)
    with trainer.rollout_weights_loaded():
        assert same(trainer.compute_log_probs(samples), v0)
    assert same(trainer.compute_log_probs(samples), v1)
    assert same(list(params(trainer).values()), list(trained.values()), atol=0)
    assert same(trainer.compute_log_probs(samples, "old_actor"), v0)  # the old actor is left as it was


def test_keep_old_actor_with_a_longer_interval_takes_the_current_weights_at_each_sync(base_args):
    trainer, samples = (
        FSDPTrainer(with_args(base_args, keep_old_actor=True, update_weights_interval=2)),
        make_samples(),
    )
    trainer.after_weight_sync()
    train(trainer, 0, samples)
    trainer.after_weight_sync()
    synced = trainer.compute_log_probs(samples)
    assert same(trainer.compute_log_probs(samples, "old_actor"), synced)
    train(trainer, 1, samples)  # between two syncs: the engines still hold what the old actor holds
    with trainer.rollout_weights_loaded():
        assert same(trainer.compute_log_probs(samples), synced)
    assert not same(trainer.compute_log_probs(samples), synced, atol=1e-4)


# ------------------------------------------------------------------- entropy and --rollout-data-postprocess-path
SEEN: dict = {}


def zero_every_loss_mask(args, rollout_id, rollout_data):
    """A --rollout-data-postprocess-path hook: records what it got, then masks every token out."""
    SEEN.update(rollout_id=rollout_id, keys=set(rollout_data), entropy=rollout_data["entropy"])
    for i, mask in enumerate(rollout_data["loss_masks"]):
        rollout_data["loss_masks"][i] = torch.zeros_like(mask)


def test_postprocess_hook_sees_the_rollout_data_and_its_loss_masks_are_trained_on(base_args):
    args = with_args(
        base_args, use_rollout_entropy=True, rollout_data_postprocess_path=f"{__name__}.zero_every_loss_mask"
    )
    trainer, samples = FSDPTrainer(args), make_samples()
    before = params(trainer)
    _, expected_entropy = trainer.compute_log_probs_and_entropy(samples)
    metrics = train(trainer, 3, samples)
    assert SEEN["rollout_id"] == 3
    assert {"tokens", "loss_masks", "log_probs", "advantages", "rewards", "entropy", "samples"} <= SEEN[
        "keys"
    ]
    assert same(SEEN["entropy"], expected_entropy)
    tokens = sum(s.response_length for s in samples)
    assert metrics["rollout_entropy"] == pytest.approx(
        float(torch.cat(expected_entropy).sum()) / tokens, rel=1e-5
    )
    assert metrics["grad_norm"] == 0.0  # every token masked out by the hook
    assert all(torch.equal(p, before[n]) for n, p in params(trainer).items())


# ------------------------------------------------------------------------------------- --use-stateless-adam
def test_stateless_adam_restarts_its_moments_every_step(base_args):
    args = with_args(base_args, optimizer="adam", no_save_optim=True)
    samples = make_samples()
    stateless = FSDPTrainer(with_args(args, use_stateless_adam=True))
    cleared, stateful = FSDPTrainer(args), FSDPTrainer(args)
    for rollout_id in range(2):
        train(stateless, rollout_id, samples)
        assert not stateless.optimizer.state  # nothing kept between steps
        train(stateful, rollout_id, samples)
        train(cleared, rollout_id, samples)
        cleared.optimizer.state.clear()  # by hand: what the flag does
    assert all(
        torch.equal(p, q) for p, q in zip(params(stateless).values(), params(cleared).values(), strict=True)
    )
    assert not all(
        torch.allclose(p, q)
        for p, q in zip(params(stateless).values(), params(stateful).values(), strict=True)
    )


# -------------------------------------------------------------------------------------------------- --ci-*
def test_ci_checks_fail_on_what_they_check(base_args, tmp_path):
    samples = make_samples()
    checker = FSDPTrainer(with_args(base_args, ci_test=True))
    with pytest.raises(RuntimeError, match="train_rollout_logprob_abs_diff .* is above .*-threshold 0.1"):
        train(checker, 0, samples)  # the samples' rollout log-probs are random
    for sample, log_probs in zip(samples, checker.compute_log_probs(samples), strict=True):
        sample.rollout_log_probs = log_probs.tolist()  # as a synced engine would have them
    train(checker, 0, samples)  # a healthy first step passes every check
    lenient = with_args(base_args, ci_test=True, ci_train_rollout_logprob_abs_diff_threshold=10.0)
    kl_checked = FSDPTrainer(lenient)
    shifted = [lp - 0.5 for lp in kl_checked.compute_log_probs(samples)]  # old log-probs of another policy
    with pytest.raises(RuntimeError, match="ppo_kl .* at the first step"):
        train(kl_checked, 0, samples, log_probs=shifted)
    train(FSDPTrainer(with_args(lenient, ci_disable_kl_checker=True)), 0, samples, log_probs=shifted)

    pattern = str(tmp_path / "{role}_{rollout_id}_{step_id}.pt")
    train(FSDPTrainer(with_args(base_args, ci_save_grad_norm=pattern)), 0, samples)
    saved = tmp_path / "actor_0_0.pt"
    train(FSDPTrainer(with_args(base_args, ci_load_grad_norm=pattern)), 0, samples)  # same run, same norm
    torch.save(float(torch.load(saved)) * 2 + 1, saved)
    with pytest.raises(RuntimeError, match="--ci-load-grad-norm: actor grad norm"):
        train(FSDPTrainer(with_args(base_args, ci_load_grad_norm=pattern)), 0, samples)


# ---------------------------------------------------------------------------------- --save-debug-train-data
def test_save_debug_train_data_writes_the_training_inputs(base_args, tmp_path):
    args = with_args(base_args, save_debug_train_data=str(tmp_path / "train_{rollout_id}_{rank}.pt"))
    trainer, samples = FSDPTrainer(args), make_samples()
    old_log_probs = trainer.compute_log_probs(samples)
    train(trainer, 5, samples)
    dump = torch.load(tmp_path / "train_5_0.pt", weights_only=False)
    assert dump["rollout_id"] == 5 and dump["sample_indices"] == list(range(8))
    assert [len(t) for t in dump["tokens"]] == [p + r for p, r in SHAPES]
    assert [len(a) for a in dump["advantages"]] == [r for _, r in SHAPES]
    assert dump["rewards"] == shape_rewards(args, [samples[:4], samples[4:]])
    assert same(dump["old_log_probs"], old_log_probs)


# ------------------------------------------------------- micro-batches: forward budget and --balance-by-flops
def test_forward_only_passes_use_the_log_probs_token_budget(base_args):
    args = with_args(base_args, use_dynamic_batch_size=True, max_tokens_per_gpu=16)
    calls = []

    def count_forwards(module, *_):
        calls.append(1)

    samples = make_samples()
    for budget, expected in ((16, None), (200, 1)):
        trainer = FSDPTrainer(with_args(args, log_probs_max_tokens_per_gpu=budget))
        handle = trainer.model.register_forward_pre_hook(count_forwards)
        calls.clear()
        trainer.compute_log_probs(samples)
        handle.remove()
        if expected is None:
            assert len(calls) == len(trainer._micro_batches(samples)) > 1  # the training budget's packing
        else:
            assert len(calls) == expected  # all 58 tokens in one forward


class _FakeTrainer(TrainerBase):
    """Only what micro-batch planning reads: the flags and a one-rank data-parallel group."""

    def __init__(self, args):
        init_distributed()
        self.args, self.dp = args, DataParallel(0, 1)


def test_balance_by_flops_packs_micro_batches_by_estimated_flops(base_args, model_dir):
    lengths = [4000, 2000, 1000, 1000, 1000, 1000]  # attention makes the 4000 tokens cost more than the rest
    samples = [Sample(index=i, tokens=[5] * n, response_length=1) for i, n in enumerate(lengths)]
    args = with_args(base_args, use_dynamic_batch_size=True, max_tokens_per_gpu=5000)
    by_tokens = _FakeTrainer(args)._micro_batches(samples)
    by_flops = _FakeTrainer(with_args(args, balance_by_flops=True))._micro_batches(samples)
    flops = sequence_flops(lengths, str(model_dir))
    spread = [max(sum(flops[i] for i in mb) for mb in mbs) for mbs in (by_tokens, by_flops)]
    assert len(by_flops) == len(by_tokens) == 2  # slime: the tokens' share of the budget
    assert spread[1] < 0.95 * spread[0]  # the heaviest micro-batch is lighter
    assert by_flops == [[0], [1, 2, 3, 4, 5]]  # 6000 tokens: the budget is not enforced, as in slime


# -------------------------------------------------------------------------------------- --log-probs-chunk-size
class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_log_probs_chunk_size_bounds_the_vocab_sized_temporaries():
    logits, labels = torch.randn(64, 100, dtype=torch.bfloat16), torch.randint(0, 100, (64,))
    results = {}
    for chunk in (-1, 8):
        with _LargestTensor() as mode:
            results[chunk] = token_log_probs(logits, labels, 0.7, with_entropy=True, chunk_size=chunk)
        results[chunk] += (mode.largest,)
    assert results[-1][2] >= 64 * 100 and results[8][2] <= 8 * 100
    torch.testing.assert_close(results[8][0], results[-1][0])
    torch.testing.assert_close(results[8][1], results[-1][1])


# ----------------------------------------------------------------------------------- --recompute-loss-function
def test_recompute_loss_function_keeps_less_for_backward_and_gives_the_same_update(base_args):
    samples, saved, updated = make_samples(), {}, {}
    for recompute in (False, True):
        trainer = FSDPTrainer(with_args(base_args, recompute_loss_function=recompute, entropy_coef=0.01))
        nbytes = []

        def pack(t, nbytes=nbytes):
            nbytes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            train(trainer, 0, samples)
        saved[recompute], updated[recompute] = sum(nbytes), params(trainer)
    assert saved[True] < saved[False]
    for name, p in updated[True].items():
        torch.testing.assert_close(p, updated[False][name], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------- --record-memory-history
def test_memory_recorder_dumps_after_the_chosen_rollout(base_args, tmp_path, monkeypatch):
    args = with_args(
        base_args, record_memory_history=True, memory_snapshot_dir=str(tmp_path), memory_snapshot_num_steps=2
    )
    with pytest.raises(ValueError, match="records CUDA memory: this trainer has no GPU"):
        MemoryRecorder(args, "actor", 0).start()
    with pytest.raises(ValueError, match="memray is not installed"):
        MemoryRecorder(with_args(args, memory_recorder="memray"), "actor", 0).start()
    calls = []  # PyTorch's recorder needs CUDA: record what would be asked of it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw))
    )
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    monkeypatch.setattr(
        torch._C, "_cuda_attach_out_of_memory_observer", lambda fn: calls.append(("oom",)), raising=False
    )
    recorder = MemoryRecorder(args, "actor", 3)
    recorder.start()
    assert recorder.after_rollout(0) is None and recorder.after_rollout(1) == recorder.path
    assert recorder.path.parent == tmp_path and "actor_rank3" in recorder.path.name
    assert [c[0] for c in calls] == ["record", "oom", "dump", "record"]
    assert calls[2][1] == str(recorder.path) and calls[3][1] == {"enabled": None}
    assert recorder.after_rollout(1) is None  # once
