"""Routing replay in the FSDP trainer on a tiny Qwen3-MoE (one rank, gloo on CPU, fp32): ``--use-routing-replay``
records the old-log-prob pass's routing and the training step replays exactly it, whatever the packing;
``--use-rollout-routing-replay`` makes every actor forward (old log-probs, reference, training, recompute inside
backward) use the rollout's experts at their packed positions; replaying the model's own choice changes nothing."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from vime.backends.fsdp_utils.routing_replay import attach_routing_replay, router_modules
from vime.backends.fsdp_utils.trainer import FSDPTrainer
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils.arguments import parse_args
from vime.utils.routing_replay import ReplayMode, RoutingReplay
from vime.utils.train_data import pack_routing
from vime.utils.types import Sample, Status

SHAPES = [(3, 2), (5, 7), (1, 4), (8, 1), (2, 9), (4, 4), (6, 3), (2, 2)]  # (prompt, response) of 8 samples
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
LAYERS, TOPK, EXPERTS = 2, 2, 4


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    """The tiny model's MoE variant (4 experts, top-2), routers spread out so that routing matters."""
    out = tmp_path_factory.mktemp("moe") / "model"
    build_tiny_model(out, seed=0, task=None, num_experts=EXPERTS, num_experts_per_tok=TOPK)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        for router in router_modules(model).values():
            router.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    model.save_pretrained(out)
    return out


def make_args(model_dir: Path, *flags: str) -> argparse.Namespace:
    return parse_args(
        [
            "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-rollout", "4",
            "--lr", "1e-2", "--weight-decay", "0", "--micro-batch-size", "2", *flags,
        ]
    )  # fmt: skip


def make_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    return [
        Sample(index=i, tokens=torch.randint(4, 61, (p + r,), generator=g).tolist(), response_length=r,
               reward=reward, status=Status.COMPLETED, rollout_log_probs=(-torch.rand(r, generator=g)).tolist())
        for i, ((p, r), reward) in enumerate(zip(SHAPES, REWARDS, strict=True))
    ]  # fmt: skip


def hf_model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def own_routing(model, tokens: list[int]) -> np.ndarray:
    """[len(tokens), layers, topk] experts a plain transformers forward of one sequence picks."""
    seen = {}
    handles = [
        r.register_forward_hook(lambda m, i, out, layer=layer: seen.__setitem__(layer, out[2]))
        for layer, r in router_modules(model).items()
    ]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for h in handles:
        h.remove()
    return torch.stack([seen[layer] for layer in range(LAYERS)], dim=1).numpy().astype(np.uint8)


def other_experts(route: np.ndarray) -> np.ndarray:
    """For every token and layer, the two experts not in ``route`` (4 experts, top-2)."""
    return np.array(
        [[[e for e in range(EXPERTS) if e not in row] for row in token] for token in route], np.uint8
    )


def forced_log_probs(model, sample: Sample, route: np.ndarray) -> torch.Tensor:
    """One sequence through plain transformers with its first ``len(route)`` tokens routed to ``route``."""
    replay = RoutingReplay(LAYERS, TOPK)
    attach_routing_replay(model, replay)
    replay.start(ReplayMode.REPLAY)
    replay.push(pack_routing([route], [len(sample.tokens)]))
    with torch.no_grad():
        logits = model(torch.tensor([sample.tokens])).logits[0]
    replay.stop()
    positions = torch.arange(sample.prompt_length - 1, len(sample.tokens) - 1)
    return torch.log_softmax(logits, -1)[positions, torch.tensor(sample.tokens[sample.prompt_length :])]


class RouterCalls:
    """Logs the experts every router of ``model`` uses (after vime's hook), with the replay mode of the call."""

    def __init__(self, trainer: FSDPTrainer, model=None):
        self.calls: list[tuple[str, int, torch.Tensor]] = []
        replay = trainer.routing.replay
        for layer, router in router_modules(model or trainer.model).items():
            router.register_forward_hook(
                lambda m, i, out, layer=layer: self.calls.append((replay.mode.value, layer, out[2].clone()))
            )

    def experts(self, mode: str, layer: int) -> torch.Tensor:
        return torch.cat([e for m, lay, e in self.calls if m == mode and lay == layer])


def full_params(trainer: FSDPTrainer) -> dict[str, torch.Tensor]:
    return {name: t.clone() for bucket in trainer.iter_weight_buckets(1 << 30) for name, t in bucket}


# ------------------------------------------------------------------------------------- --use-routing-replay
def test_training_replays_exactly_the_routing_the_old_log_prob_pass_recorded(moe_dir):
    # 2 optimizer steps of 4 samples, micro-batches of <= 16 tokens: the old-log-prob pass packs all 8 samples
    # otherwise than the two steps do, so recorded rows must move to other packed positions
    batching = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "16", "--num-steps-per-rollout", "2"]
    trainer = FSDPTrainer(make_args(moe_dir, "--use-routing-replay", *batching))
    calls = RouterCalls(trainer)
    samples = make_samples()
    old = trainer.compute_log_probs(samples)
    recorded = {
        i: trainer.routing._recorded[(len(s.tokens), hash(tuple(s.tokens)))] for i, s in enumerate(samples)
    }
    reference = hf_model(moe_dir)
    for i, s in enumerate(samples):  # what was recorded is the model's own routing
        assert np.array_equal(recorded[i].numpy(), own_routing(reference, s.tokens)), i
    trainer.train(0, samples, REWARDS, log_probs=old)
    training = [
        [4 * step + i for i in mb]
        for step in (0, 1)
        for mb in trainer._micro_batches(samples[4 * step :][:4])
    ]
    assert sorted(training) != sorted(trainer._micro_batches(samples))
    expected = torch.cat([recorded[i] for mb in training for i in mb])
    for layer in range(LAYERS):
        used = calls.experts("replay", layer)
        assert torch.equal(used, expected[:, layer].long())
    assert trainer.routing._recorded == {}  # the step's routing is forgotten after it


def test_routing_replay_needs_a_moe_model(tmp_path):
    dense = build_tiny_model(tmp_path / "dense", seed=0, task=None)
    with pytest.raises(ValueError, match="--use-rollout-routing-replay replays .* is a dense model"):
        FSDPTrainer(make_args(dense, "--use-rollout-routing-replay"))


# ------------------------------------------------------------------------------ --use-rollout-routing-replay
@pytest.mark.parametrize(
    "batching", [["--micro-batch-size", "4"], ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "20"]]
)
def test_every_actor_forward_uses_the_rollouts_experts_at_their_packed_positions(moe_dir, batching):
    samples = make_samples()
    reference = hf_model(moe_dir)
    forced = [
        other_experts(own_routing(reference, s.tokens))[:-1] for s in samples
    ]  # the engine's len - 1 rows
    for s, route in zip(samples, forced, strict=True):
        s.rollout_routed_experts = route
    args = make_args(
        moe_dir, "--use-rollout-routing-replay", "--use-kl-loss", "--kl-loss-coef", "0.1", *batching
    )
    trainer = FSDPTrainer(args)
    calls = RouterCalls(trainer)
    RouterCalls.__init__(
        calls, trainer, trainer.ref_model
    )  # log the reference model's routers too (same list)
    free = FSDPTrainer(make_args(moe_dir, *batching)).compute_log_probs(samples)

    old = trainer.compute_log_probs(samples)
    ref = trainer.compute_log_probs(samples, "ref")
    for s, route, lp, r, lp_free in zip(samples, forced, old, ref, free, strict=True):
        want = forced_log_probs(hf_model(moe_dir), s, route)
        torch.testing.assert_close(lp, want, rtol=0, atol=2e-5)
        assert torch.equal(lp, r)  # the reference has the same weights and replays the same experts
        assert not torch.allclose(lp, lp_free, atol=1e-3)  # and the forced experts do change the output

    calls.calls.clear()
    trainer.train(0, samples, REWARDS)
    # train() replays in its old-log-prob pass, the reference pass and the training forward, all packed alike:
    # in each, the first len(tokens) - 1 tokens of every sample use the rollout's experts, the last its own
    order = [i for mb in trainer._micro_batches(samples) for i in mb]
    expected = torch.cat([torch.from_numpy(forced[i]).long() for i in order])
    replayed = torch.cat([torch.tensor([True] * (len(samples[i].tokens) - 1) + [False]) for i in order])
    for layer in range(LAYERS):
        used = calls.experts("replay", layer)
        assert len(used) == 3 * len(replayed)
        for part in used.split(len(replayed)):
            assert torch.equal(part[replayed], expected[:, layer])


def test_the_paired_diff_without_replay_scores_the_same_batch_on_the_trainers_own_routing(moe_dir):
    """--log-logprob-diff-without-replay: R3's step also reports the diff its batch has on the trainer's routing."""
    samples = make_samples()
    for s in samples:
        s.rollout_routed_experts = other_experts(own_routing(hf_model(moe_dir), s.tokens))[:-1]
    free = FSDPTrainer(make_args(moe_dir)).compute_log_probs(samples)
    replayed = FSDPTrainer(make_args(moe_dir, "--use-rollout-routing-replay")).compute_log_probs(samples)
    trainer = FSDPTrainer(
        make_args(moe_dir, "--use-rollout-routing-replay", "--log-logprob-diff-without-replay")
    )
    metrics = trainer.train(0, samples, REWARDS)

    def diff(log_probs):
        pairs = zip(log_probs, samples, strict=True)
        tokens = torch.cat([(lp - torch.tensor(s.rollout_log_probs)).abs() for lp, s in pairs])
        return float(tokens.mean())

    assert metrics["train_rollout_logprob_abs_diff"] == pytest.approx(diff(replayed), abs=1e-6)
    assert metrics["train_rollout_logprob_abs_diff_without_replay"] == pytest.approx(diff(free), abs=1e-6)
    assert abs(diff(free) - diff(replayed)) > 1e-3  # the forced experts make the two passes differ
    with pytest.raises((SystemExit, ValueError)):  # without R3 the logged diff already is that: refused
        make_args(moe_dir, "--log-logprob-diff-without-replay")


def test_replaying_the_models_own_routing_changes_nothing(moe_dir):
    samples = make_samples()
    reference = hf_model(moe_dir)
    for s in samples:
        s.rollout_routed_experts = own_routing(reference, s.tokens)[:-1]
    replaying = FSDPTrainer(make_args(moe_dir, "--use-rollout-routing-replay"))
    plain = FSDPTrainer(make_args(moe_dir))
    for a, b in zip(replaying.compute_log_probs(samples), plain.compute_log_probs(samples), strict=True):
        assert torch.equal(a, b)
    got, want = replaying.train(0, samples, REWARDS), plain.train(0, samples, REWARDS)
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    after, after_plain = full_params(replaying), full_params(plain)
    for name in after:
        assert torch.equal(after[name], after_plain[name]), name


def test_recompute_in_backward_replays_the_same_experts(moe_dir):
    """--gradient-checkpointing recomputes each layer (its router too) inside backward: the step must equal the
    one without recompute, with experts the model would not have chosen."""
    samples = make_samples()
    reference = hf_model(moe_dir)
    for s in samples:
        s.rollout_routed_experts = other_experts(own_routing(reference, s.tokens))[:-1]
    results = []
    for extra in ([], ["--gradient-checkpointing"]):
        trainer = FSDPTrainer(make_args(moe_dir, "--use-rollout-routing-replay", *extra))
        metrics = trainer.train(0, samples, REWARDS)
        results.append((metrics["grad_norm"], full_params(trainer)))
    (norm, params), (norm_ckpt, params_ckpt) = results
    assert norm == pytest.approx(norm_ckpt, rel=1e-6)
    for name in params:
        torch.testing.assert_close(params[name], params_ckpt[name], rtol=0, atol=1e-6, msg=name)


def test_rollout_routing_is_checked_against_the_model(moe_dir):
    trainer = FSDPTrainer(make_args(moe_dir, "--use-rollout-routing-replay"))
    samples = make_samples()[:1]
    with pytest.raises(ValueError, match="sample 0 has no rollout_routed_experts"):
        trainer.compute_log_probs(samples)
    samples[0].rollout_routed_experts = np.zeros((len(samples[0].tokens) - 1, 3, TOPK), np.uint8)
    with pytest.raises(ValueError, match=r"expected \[<= 5 tokens, 2 layers, top-2\]"):
        trainer.compute_log_probs(samples)
    samples[0].rollout_routed_experts = np.full((4, LAYERS, TOPK), 4, np.uint8)
    with pytest.raises(ValueError, match="expert id 4 >= the model's 4 experts"):
        trainer.compute_log_probs(samples)
    samples[0].rollout_routed_experts = np.zeros(
        (2, LAYERS, TOPK), np.uint8
    )  # 3-token prompt, 2 trained tokens
    with pytest.raises(ValueError, match="cover 2 of its 5 tokens"):
        trainer.compute_log_probs(samples)
    failed = copy.deepcopy(make_samples()[:1])
    failed[0].status = Status.FAILED  # a sample that does not train may come without routing
    assert trainer.compute_log_probs(failed)[0].shape == (2,)
