"""The model families ``make_tiny_model --arch`` builds, in the FSDP trainer (one rank, gloo on CPU, fp32): packed
log-probs equal transformers' own forward, a training step moves them, weight sync and HF export are the checkpoint's
tensors bit for bit, and an exported model is the trainer's. Megatron's side without Megatron (names, layouts, TP
shards and the flags slime's model scripts give) is in test_megatron_families.py; with Megatron on the GPU machine in
tests/gpu/test_megatron_gpu.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from vime.backends.fsdp_utils.trainer import FSDPTrainer
from vime.tools.make_tiny_model import VOCAB_SIZE, build_tiny_model
from vime.utils.arguments import parse_args
from vime.utils.train_data import shape_rewards
from vime.utils.types import Sample, Status

FAMILIES = ["qwen2", "deepseek_v3", "qwen3_next"]
# (prompt length, response length) of 8 samples = 2 groups of 4, packed into one row
SHAPES = [(3, 2), (5, 7), (1, 4), (8, 1), (2, 9), (4, 4), (6, 3), (2, 2)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {arch: build_tiny_model(root / arch, arch=arch, task=None) for arch in FAMILIES}


def trainer_for(model_dir: Path, *flags: str) -> FSDPTrainer:
    args = parse_args(
        [
            "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-rollout", "4",
            "--micro-batch-size", "8", "--lr", "1e-2", "--weight-decay", "0", *flags,
        ]
    )  # fmt: skip
    return FSDPTrainer(args)


def make_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    return [
        Sample(index=i, tokens=torch.randint(4, VOCAB_SIZE, (p + r,), generator=g).tolist(), response_length=r,
               reward=float(i % 2), status=Status.COMPLETED)
        for i, (p, r) in enumerate(SHAPES)
    ]  # fmt: skip


def transformers_log_probs(model_dir: Path, samples: list[Sample]) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor([s.tokens])).logits[0].float()
            positions = torch.arange(s.prompt_length - 1, len(s.tokens) - 1)
            out.append(torch.log_softmax(logits, -1)[positions, torch.tensor(s.tokens[s.prompt_length :])])
    return out


def mean_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(torch.cat([(x - y).abs() for x, y in zip(a, b, strict=True)]).mean())


def safetensors_of(model_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("arch", FAMILIES)
def test_fsdp_packed_log_probs_match_transformers(model_dirs, arch):
    samples = make_samples()
    got = trainer_for(model_dirs[arch]).compute_log_probs(samples)  # all 8 samples in one packed row
    want = transformers_log_probs(model_dirs[arch], samples)
    diff = mean_abs_diff(got, want)
    print(f"\n[{arch}] FSDP fp32 log-probs vs transformers: mean |diff| {diff:.2e}")
    assert diff <= 2e-7


@pytest.mark.parametrize("arch", FAMILIES)
def test_fsdp_trains_syncs_and_exports_the_checkpoint_format(model_dirs, arch, tmp_path):
    trainer = trainer_for(model_dirs[arch])
    saved = safetensors_of(model_dirs[arch])
    synced = {name: t for bucket in trainer.iter_weight_buckets(64 * 1024) for name, t in bucket}
    assert sorted(synced) == sorted(saved)
    assert all(torch.equal(synced[name], tensor) for name, tensor in saved.items())

    samples = make_samples()
    before = trainer.compute_log_probs(samples)
    trainer.train(0, samples, shape_rewards(trainer.args, [samples[:4], samples[4:]]))
    after = trainer.compute_log_probs(samples)
    assert mean_abs_diff(after, before) > 1e-3  # the step moved the policy

    trainer.export_hf(str(tmp_path / "hf"))
    exported = safetensors_of(tmp_path / "hf")
    assert sorted(exported) == sorted(saved)
    assert mean_abs_diff(transformers_log_probs(tmp_path / "hf", samples), after) <= 2e-7
