"""``--offload-train`` at the trainer level on one GPU: offloading frees the GPU memory of the weights, gradients
and optimizer state, and a trainer that was offloaded and brought back between two steps ends bit-identical to one
that never left the GPU (FSDP2 and Megatron, bf16 with Adam state)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gpu_samples import random_samples

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = [(3, 2), (5, 7), (1, 4), (8, 1)]  # (prompt, response) tokens of 4 samples: 2 groups of 2


def _args(backend, model_dir):
    from vime.backends.megatron_utils.hf_config import flags_from_hf_config, flags_to_argv, load_hf_config
    from vime.utils.arguments import parse_args

    argv = [
        "--train-backend", backend, "--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2", "--bf16",
        "--lr", "1e-3", "--micro-batch-size", "2",
    ]  # fmt: skip
    if backend == "megatron":
        argv += flags_to_argv(flags_from_hf_config(load_hf_config(model_dir)))
    return parse_args(argv)


def _weights(trainer):
    return {n: t.float().cpu() for b in trainer.iter_weight_buckets(1 << 30) for n, t in b}


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_offload_frees_memory_and_training_resumes_bit_for_bit(backend, tmp_path):
    if backend == "megatron" and importlib.util.find_spec("megatron.core") is None:
        pytest.skip("needs megatron-core")
    from vime.tools.make_tiny_model import build_tiny_model
    from vime.utils.train_data import shape_rewards

    if backend == "megatron":
        from vime.backends.megatron_utils.trainer import MegatronTrainer as Trainer
    else:
        from vime.backends.fsdp_utils.trainer import FSDPTrainer as Trainer
    model_dir = build_tiny_model(tmp_path / "model", seed=0, task=None, num_layers=4, hidden_size=512,
                                 intermediate_size=2048)  # fmt: skip
    args = _args(backend, model_dir)
    samples = random_samples(SHAPES)
    rewards = shape_rewards(args, [samples[:2], samples[2:]])

    stays = Trainer(args)
    stays.train(0, samples, rewards)
    stays.train(1, samples, rewards)
    want = _weights(stays)
    del stays
    torch.cuda.empty_cache()

    moves = Trainer(args)
    moves.train(0, samples, rewards)
    figures = moves.offload()
    params = [p for p in (moves.module if backend == "megatron" else moves.model).parameters()]
    local = [getattr(p, "to_local", lambda p=p: p)() for p in params]
    assert all(t.untyped_storage().nbytes() == 0 for t in local)  # weights gone from the GPU
    # bf16 weights + fp32 master copies / grads + Adam moments: several bytes per parameter come back
    numel = sum(p.numel() for p in params)
    assert figures["offload/freed_gib"] * 2**30 > 8 * numel, (figures, numel)
    with pytest.raises(RuntimeError, match="twice"):
        moves.offload()
    assert moves.onload()["time/onload_s"] >= 0
    assert moves.onload() == {}  # nothing left to bring back
    moves.train(1, samples, rewards)
    got = _weights(moves)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want), [
        n for n in want if not torch.equal(got[n], want[n])
    ]
