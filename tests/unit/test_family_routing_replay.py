"""Routing replay (R3) in the FSDP trainer for the MoE families beyond Qwen3-MoE (one rank, gloo on CPU, fp32):
DeepSeek-V3's group-limited sigmoid router with expert bias and shared experts behind a dense first layer, and
Qwen3-Next's softmax router beside a gated shared expert (its layers alternate gated DeltaNet and full attention).
Replaying the model's own routing changes nothing (bitwise); the rollout's experts reach every actor forward, weighted
by the router's own scores, as transformers forced to the same experts computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from vime.backends.fsdp_utils.routing_replay import attach_routing_replay, replayed_weights, router_modules
from vime.backends.fsdp_utils.trainer import FSDPTrainer
from vime.tools.make_tiny_model import VOCAB_SIZE, build_tiny_model
from vime.utils.arguments import parse_args
from vime.utils.routing_replay import ReplayMode, RoutingReplay
from vime.utils.train_data import pack_routing
from vime.utils.types import Sample, Status

SHAPES = [(3, 2), (5, 7), (1, 4), (8, 1), (2, 9), (4, 4), (6, 3), (2, 2)]
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]


ARCHS = ["deepseek_v3", "qwen3_next"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """deepseek_v3: 3 layers (the first dense), 8 experts in 4 groups, top-4 within the best 2 groups, a shared expert;
    qwen3_next: 2 layers (gated DeltaNet, full attention), 4 experts, top-2, a gated shared expert."""
    root = tmp_path_factory.mktemp("r3")
    return {arch: build_tiny_model(root / arch, arch=arch, task=None) for arch in ARCHS}


@pytest.fixture
def deepseek(models) -> Path:
    return models["deepseek_v3"]


def hf_model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_args(model_dir: Path, *flags: str):
    return parse_args(
        [
            "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-rollout", "4",
            "--lr", "1e-2", "--weight-decay", "0", "--micro-batch-size", "4", *flags,
        ]
    )  # fmt: skip


def make_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    return [
        Sample(index=i, tokens=torch.randint(4, VOCAB_SIZE, (p + r,), generator=g).tolist(), response_length=r,
               reward=reward, status=Status.COMPLETED, rollout_log_probs=(-torch.rand(r, generator=g)).tolist())
        for i, ((p, r), reward) in enumerate(zip(SHAPES, REWARDS, strict=True))
    ]  # fmt: skip


def own_routing(model, tokens: list[int]) -> np.ndarray:
    """[len(tokens), layers, topk] experts a plain forward picks (the dense layer's rows are 0, as vLLM's are)."""
    config = model.config
    route = torch.zeros(len(tokens), config.num_hidden_layers, config.num_experts_per_tok, dtype=torch.long)

    def keep(layer: int):
        def hook(module, inputs, out) -> None:  # returns None: the router's output stays as it is
            route[:, layer] = out[2]

        return hook

    handles = [r.register_forward_hook(keep(layer)) for layer, r in router_modules(model).items()]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for h in handles:
        h.remove()
    return route.numpy().astype(np.uint8)


def other_experts(route: np.ndarray, experts: int) -> np.ndarray:
    """Per token and layer, top-k experts not in ``route`` (8 experts, top-4: the other four; the dense layer's
    rows are never read)."""
    topk = route.shape[-1]
    return np.array(
        [[[e for e in range(experts) if e not in row][:topk] for row in token] for token in route], np.uint8
    )


def forced_log_probs(model, sample: Sample, route: np.ndarray) -> torch.Tensor:
    replay = RoutingReplay(model.config.num_hidden_layers, model.config.num_experts_per_tok)
    attach_routing_replay(model, replay)
    replay.start(ReplayMode.REPLAY)
    replay.push(pack_routing([route], [len(sample.tokens)]))
    with torch.no_grad():
        logits = model(torch.tensor([sample.tokens])).logits[0]
    replay.stop()
    positions = torch.arange(sample.prompt_length - 1, len(sample.tokens) - 1)
    return torch.log_softmax(logits, -1)[positions, torch.tensor(sample.tokens[sample.prompt_length :])]


def test_sigmoid_router_hook_weighs_replayed_experts_by_their_own_sigmoid_scores(deepseek):
    model = hf_model(deepseek)
    routers = router_modules(model)
    assert sorted(routers) == [1, 2]  # layer 0 is dense
    router = routers[1]
    hidden = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    logits, weights, own = router(hidden)
    assert torch.equal(replayed_weights(router, logits, own), weights)  # its own choice: bitwise
    chosen = torch.tensor([[0, 1, 2, 3]] * 6)
    scores = torch.sigmoid(logits).gather(1, chosen)
    want = 2.5 * scores / (scores.sum(-1, keepdim=True) + 1e-20)  # routed_scaling_factor 2.5, renormalised
    torch.testing.assert_close(replayed_weights(router, logits, chosen), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_replaying_the_own_routing_changes_nothing(models, arch):
    model_dir = models[arch]
    samples = make_samples()
    reference = hf_model(model_dir)
    for s in samples:
        s.rollout_routed_experts = own_routing(reference, s.tokens)[:-1]
    replaying = FSDPTrainer(make_args(model_dir, "--use-rollout-routing-replay"))
    plain = FSDPTrainer(make_args(model_dir))
    for a, b in zip(replaying.compute_log_probs(samples), plain.compute_log_probs(samples), strict=True):
        assert torch.equal(a, b)
    got, want = replaying.train(0, samples, REWARDS), plain.train(0, samples, REWARDS)
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]


@pytest.mark.parametrize("arch", ARCHS)
def test_r3_forces_the_rollouts_experts_in_every_actor_forward(models, arch):
    model_dir = models[arch]
    samples = make_samples()
    reference = hf_model(model_dir)
    experts = reference.config.num_local_experts if arch == "deepseek_v3" else reference.config.num_experts
    forced = [other_experts(own_routing(reference, s.tokens), experts)[:-1] for s in samples]
    for s, route in zip(samples, forced, strict=True):
        s.rollout_routed_experts = route
    trainer = FSDPTrainer(make_args(model_dir, "--use-rollout-routing-replay"))
    free = FSDPTrainer(make_args(model_dir)).compute_log_probs(samples)
    old = trainer.compute_log_probs(samples)
    moved = 0.0
    for s, route, lp, lp_free in zip(samples, forced, old, free, strict=True):
        torch.testing.assert_close(lp, forced_log_probs(hf_model(model_dir), s, route), rtol=0, atol=2e-6)
        moved = max(moved, float((lp - lp_free).abs().max()))
    assert moved > 1e-2  # the forced experts do change the output
    metrics = trainer.train(0, samples, REWARDS)
    assert metrics["grad_norm"] > 0 and np.isfinite(metrics["loss"])
