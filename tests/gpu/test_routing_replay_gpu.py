"""Routing replay on one CUDA GPU (issue 12's acceptance), on a small random-init Qwen3-MoE (4 experts, top-2):

- both trainers with ``--use-rollout-routing-replay`` route every token the engine ran (all but each sample's
  last) to the rollout's experts in the old-log-prob, reference and training passes, with experts the model would
  not pick, and give the log-probs of transformers forced to the same experts;
- the Megatron trainer with ``--use-routing-replay`` records its own routing and trains on exactly it;
- a real vLLM engine started as vime starts it returns routed experts that equal what the trainer's routers pick
  on the same weights (fp32: all equal; bf16: the agreement rate is printed), and with R3 the trainer's routing
  equals the engine's exactly.

Run (tests/gpu/README.md): ``python3 -m pytest -q -s tests/gpu/test_routing_replay_gpu.py`` with megatron-core;
the engine case needs the full kit (``bash tests/gpu/run.sh tests/gpu/test_routing_replay_gpu.py``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_megatron_gpu import build_moe, make_args, samples_for_test  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    # the flags of both backends' runs come from Megatron's model flags (test_megatron_gpu.make_args)
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]
NEEDS_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (the GPU kit)")
LAYERS, TOPK, EXPERTS = 2, 2, 4


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return str(build_moe(tmp_path_factory.mktemp("r3") / "moe"))


def hf_model(model_dir: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()


def own_routing(model, tokens: list[int]) -> np.ndarray:
    """[len(tokens), layers, topk] experts transformers' routers pick for one sequence."""
    from vime.backends.fsdp_utils.routing_replay import router_modules

    seen = {}
    handles = [
        r.register_forward_hook(lambda m, i, out, layer=layer: seen.__setitem__(layer, out[2].cpu()))
        for layer, r in router_modules(model).items()
    ]
    with torch.no_grad():
        model(torch.tensor([tokens], device="cuda"))
    for h in handles:
        h.remove()
    return torch.stack([seen[layer] for layer in range(LAYERS)], dim=1).numpy().astype(np.uint8)


def other_experts(route: np.ndarray) -> np.ndarray:
    return np.array(
        [[[e for e in range(EXPERTS) if e not in row] for row in token] for token in route], np.uint8
    )


def forced_log_probs(model_dir: str, samples, routes) -> list[torch.Tensor]:
    """transformers' fp32 log-probs with each sample's first ``len(route)`` tokens routed to ``route``."""
    from vime.backends.fsdp_utils.routing_replay import attach_routing_replay
    from vime.utils.routing_replay import ReplayMode, RoutingReplay
    from vime.utils.train_data import pack_routing

    model = hf_model(model_dir)
    replay = RoutingReplay(LAYERS, TOPK)
    attach_routing_replay(model, replay)
    out = []
    for s, route in zip(samples, routes, strict=True):
        replay.start(ReplayMode.REPLAY)
        replay.push(pack_routing([route], [len(s.tokens)]).to("cuda"))
        with torch.no_grad():
            logits = model(torch.tensor([s.tokens], device="cuda")).logits[0].float().cpu()
        replay.stop()
        positions = torch.arange(s.prompt_length - 1, len(s.tokens) - 1)
        out.append(torch.log_softmax(logits, -1)[positions, torch.tensor(s.tokens[s.prompt_length :])])
    return out


class RoutingLog:
    """The experts every router of a trainer's models used, per call: (replay mode, layer, [tokens, topk])."""

    def __init__(self, trainer, backend: str):
        self.calls = []
        modules = [trainer.module] + ([trainer.ref_model] if trainer.ref_model is not None else [])
        replay = trainer.routing.replay
        for module in modules:
            for layer, router in self._routers(module, backend):
                router.register_forward_hook(self._hook(replay, layer, backend))

    @staticmethod
    def _routers(module, backend: str):
        if backend == "fsdp":
            from vime.backends.fsdp_utils.routing_replay import router_modules

            return router_modules(module).items()
        from megatron.core.transformer.moe.router import TopKRouter

        return [(r.layer_number - 1, r) for r in module.modules() if isinstance(r, TopKRouter)]

    def _hook(self, replay, layer: int, backend: str):
        def hook(module, inputs, output):
            if backend == "fsdp":
                experts = output[2]
            else:  # Megatron: (probs, routing_map [tokens, experts])
                experts = output[1].nonzero()[:, 1].view(-1, TOPK)
            self.calls.append((replay.mode.value, layer, experts.sort(dim=-1).values.cpu()))

        return hook

    def check_replayed(self, samples, routes, passes: int) -> int:
        """Every logged replay call of each layer, split into ``passes`` passes over the samples (packed in order:
        fixed-size micro-batches), used ``routes`` on each sample's first len(route) tokens; returns the number of
        token rows checked."""
        checked = 0
        for layer in range(LAYERS):
            used = torch.cat([e for mode, lay, e in self.calls if mode == "replay" and lay == layer])
            assert len(used) == passes * sum(len(s.tokens) for s in samples), (len(used), passes)
            for part in used.split(len(used) // passes):
                offset = 0
                for s, route in zip(samples, routes, strict=True):
                    want = torch.from_numpy(np.sort(route[:, layer], axis=-1).astype(np.int64))
                    assert torch.equal(part[offset : offset + len(route)], want), (layer, s.index)
                    offset += len(s.tokens)
                    checked += len(route)
        return checked


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_r3_replays_the_rollouts_experts_in_every_actor_pass(moe_dir, backend):
    from vime.utils.train_data import shape_rewards

    samples = samples_for_test()
    reference = hf_model(moe_dir)
    routes = [other_experts(own_routing(reference, s.tokens))[:-1] for s in samples]
    for s, route in zip(samples, routes, strict=True):
        s.rollout_routed_experts = route
    flags = [
        "--use-rollout-routing-replay",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.01",
        "--micro-batch-size",
        "6",
    ]
    config = make_args(moe_dir, *flags)
    config.train_backend = backend
    trainer = _trainer(backend, config)
    log = RoutingLog(trainer, backend)
    got = trainer.compute_log_probs(samples)
    want = forced_log_probs(moe_dir, samples, routes)
    worst = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
    print(
        f"\n[{backend} R3] fp32 log-probs vs transformers forced to the same experts: max |diff| {worst:.3e}"
    )
    assert worst < 1e-4
    log.calls.clear()
    rewards = shape_rewards(config, [samples[i : i + 2] for i in range(0, 6, 2)])
    metrics = trainer.train(0, samples, rewards)
    checked = log.check_replayed(samples, routes, passes=3)  # old log-probs, reference, training
    print(f"[{backend} R3] {checked} token-layer rows replayed exactly; loss {metrics['loss']:.6g}")


def test_megatron_records_its_routing_and_trains_on_it(moe_dir):
    from vime.backends.megatron_utils.trainer import MegatronTrainer

    samples = samples_for_test()
    trainer = MegatronTrainer(make_args(moe_dir, "--use-routing-replay", "--micro-batch-size", "2"))
    log = RoutingLog(trainer, "megatron")
    old = trainer.compute_log_probs(samples)
    reference = hf_model(moe_dir)
    recorded = [trainer.routing._recorded[(len(s.tokens), hash(tuple(s.tokens)))].numpy() for s in samples]
    for s, route in zip(samples, recorded, strict=True):
        assert np.array_equal(route, own_routing(reference, s.tokens)), s.index
    log.calls.clear()
    trainer.train(0, samples, [1.0, -1.0] * 3, log_probs=old)
    print(f"\n[megatron record] {log.check_replayed(samples, recorded, passes=1)} rows replayed as recorded")


def _trainer(backend: str, config):
    if backend == "fsdp":
        from vime.backends.fsdp_utils.trainer import FSDPTrainer

        return FSDPTrainer(config)
    from vime.backends.megatron_utils.trainer import MegatronTrainer

    return MegatronTrainer(config)


# ------------------------------------------------------------------------------------- a real vLLM engine
def engine_failure(response, model_dir: str, prompt: list[int], dtype: str, log_path: Path) -> str:
    """Why the engine refused a completion, in words. NaN log-probs come back as HTTP 400 ("Out of range float values
    are not JSON compliant: nan": the server cannot put NaN in JSON): then the message names the kernels the engine
    chose (its log) and whether transformers' forward of the same prompt on this GPU is finite, which tells a vLLM
    kernel (transformers finite) from the model's weights or config (transformers NaN too)."""
    if "not JSON compliant: nan" not in response.text:
        return f"HTTP {response.status_code}: {response.text[:2000]}"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).cuda()
    with torch.no_grad():
        finite = bool(torch.isfinite(model(torch.tensor([prompt], device="cuda")).logits).all())
    kernels = [
        line.split("] ", 1)[-1]
        for line in log_path.read_text().splitlines()
        if " Using " in line and ("kernel" in line or "backend" in line)
    ]
    return (
        f"the engine's log-probs are NaN (HTTP 400 '...not JSON compliant: nan'); transformers' {dtype} logits of the "
        f"same prompt on this GPU are {'finite: a vLLM kernel' if finite else 'NaN too: the model'} is the cause. "
        f"The engine chose ({log_path}):\n  " + "\n  ".join(kernels)
    )


def engine_samples(model_dir: str, dtype: str, log_path: Path, *vllm_flags: str):
    """Samples a vLLM engine (started with vime's R3 options and ``vllm_flags``) generated, with their routed
    experts."""
    import argparse

    import requests

    from vime.backends.vllm_utils.engine import VLLMEngine
    from vime.backends.vllm_utils.routed_experts import engine_options
    from vime.rollout.vllm_generate import _apply_choice
    from vime.utils.arguments import parse_args
    from vime.utils.types import Sample

    args = parse_args(
        ["--train-backend", "fsdp", "--hf-checkpoint", model_dir, "--prompt-data", "unused.jsonl",
         "--rollout-batch-size", "1", "--num-rollout", "1", "--vllm-enforce-eager", "--vllm-dtype", dtype,
         "--vllm-max-model-len", "256", "--vllm-gpu-memory-utilization", "0.3", *vllm_flags]
    )  # fmt: skip
    flags, env = engine_options(on_gpu=True)
    engine = VLLMEngine(args, log_path=log_path, extra_args=flags, env=env)
    replaying = argparse.Namespace(**{**vars(args), "use_rollout_routing_replay": True})  # R3 on
    samples = []
    with engine:
        engine.wait_ready_sync(900)
        g = torch.Generator().manual_seed(0)
        for group in range(4):
            prompt = torch.randint(4, 61, (6 + 3 * group,), generator=g).tolist()
            body = {"model": model_dir, "prompt": prompt, "max_tokens": 48, "n": 4, "temperature": 1.0,
                    "logprobs": 0, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
            response = requests.post(f"{engine.url}/v1/completions", json=body, timeout=120)
            if response.status_code != 200:
                pytest.fail(engine_failure(response, model_dir, prompt, dtype, log_path), pytrace=False)
            for choice in response.json()["choices"]:
                sample = Sample(index=len(samples), tokens=list(prompt), reward=float(len(samples) % 2))
                _apply_choice(replaying, sample, choice, 0)
                samples.append(sample)
    return samples


@NEEDS_VLLM
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_engine_routed_experts_equal_the_trainers_routing(moe_dir, backend, tmp_path):
    from vime.utils.train_data import shape_rewards

    for dtype in ("float32", "bfloat16"):
        samples = engine_samples(moe_dir, dtype, tmp_path / f"engine_{dtype}.log")
        engine = [s.rollout_routed_experts for s in samples]
        assert all(r.shape == (len(s.tokens) - 1, LAYERS, TOPK) for s, r in zip(samples, engine, strict=True))
        precision = ["--bf16"] if dtype == "bfloat16" else []
        config = make_args(moe_dir, "--use-routing-replay", "--rollout-batch-size", "4", "--n-samples-per-prompt",
                           "4", "--micro-batch-size", "4", *precision)  # fmt: skip
        config.train_backend = backend
        trainer = _trainer(backend, config)
        trainer.compute_log_probs(samples)  # records the trainer's own routing
        own = [trainer.routing._recorded[(len(s.tokens), hash(tuple(s.tokens)))].numpy() for s in samples]
        same_set = np.concatenate(
            [np.sort(o[: len(e)], -1) == np.sort(e, -1) for o, e in zip(own, engine, strict=True)]
        ).all(-1)
        agreement = float(same_set.mean())
        print(
            f"\n[{backend} {dtype}] engine vs trainer top-{TOPK} experts per token and layer: {agreement:.4%} agree"
        )
        if dtype == "float32":
            assert agreement == 1.0

        # with R3 the trainer uses exactly the engine's experts, and the train/rollout log-prob gap shrinks
        diffs = {}
        for flag in ("--use-routing-replay", "--use-rollout-routing-replay"):
            config.use_rollout_routing_replay = flag == "--use-rollout-routing-replay"
            trainer = _trainer(backend, config)
            log = RoutingLog(trainer, backend)
            rewards = shape_rewards(config, [samples[i : i + 4] for i in range(0, 16, 4)])
            metrics = trainer.train(0, samples, rewards)
            diffs[flag] = metrics["train_rollout_logprob_abs_diff"]
            if config.use_rollout_routing_replay:
                log.check_replayed(samples, engine, passes=2)  # old log-probs, training
        print(f"[{backend} {dtype}] train_rollout_logprob_abs_diff: {diffs}")
