"""The FSDP2 backend on one CUDA GPU (nccl, world size 1): the same code path as on CPU."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from gpu_samples import random_samples

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (prompt length, response length) of 6 samples: 3 groups of 2
SHAPES = [(3, 2), (5, 7), (1, 4), (8, 1), (2, 9), (4, 4)]


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    from vime.tools.make_tiny_model import build_tiny_model
    from vime.utils.arguments import parse_args

    model_dir = build_tiny_model(tmp_path_factory.mktemp("gpu") / "model", seed=0, task=None)
    return parse_args(
        [
            "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl",
            "--rollout-batch-size", "3", "--n-samples-per-prompt", "2", "--num-rollout", "1",
            "--lr", "1e-2", "--weight-decay", "0", "--micro-batch-size", "3",
        ]
    )  # fmt: skip


def test_log_probs_match_transformers_on_gpu(args):
    from transformers import AutoModelForCausalLM

    from vime.backends.fsdp_utils.trainer import FSDPTrainer

    trainer = FSDPTrainer(args)
    assert trainer.device.type == "cuda"
    samples = random_samples(SHAPES)
    got = trainer.compute_log_probs(samples)
    reference = AutoModelForCausalLM.from_pretrained(args.hf_checkpoint, dtype=torch.float32).cuda()
    with torch.no_grad():
        for s, lp in zip(samples, got, strict=True):
            logits = reference(torch.tensor([s.tokens], device="cuda")).logits[0].float().cpu()
            positions = torch.arange(s.prompt_length - 1, len(s.tokens) - 1)
            want = torch.log_softmax(logits, -1)[positions, torch.tensor(s.tokens[s.prompt_length :])]
            # different attention kernels (masked packed row vs one causal sequence): GPU fp32 tolerance
            torch.testing.assert_close(lp, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("bf16", [False, True])
def test_one_training_step_on_gpu(args, bf16):
    from vime.backends.fsdp_utils.trainer import FSDPTrainer
    from vime.utils.train_data import shape_rewards

    config = copy.deepcopy(args)
    config.bf16 = bf16
    trainer = FSDPTrainer(config)
    samples = random_samples(SHAPES)
    rewards = shape_rewards(config, [samples[i : i + 2] for i in range(0, 6, 2)])
    before = {n: t.float().cpu() for b in trainer.iter_weight_buckets(1 << 30) for n, t in b}
    metrics = trainer.train(0, samples, rewards)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["grad_norm"] > 0
    after = {n: t.float().cpu() for b in trainer.iter_weight_buckets(1 << 30) for n, t in b}
    assert any(not torch.equal(before[n], after[n]) for n in before)
    if bf16:
        assert all(t.dtype == torch.bfloat16 for b in trainer.iter_weight_buckets(1 << 30) for _, t in b)
