"""The FSDP2 backend on two CPU ranks (gloo, fp32), launched with torchrun from the tests.

This file is also the worker script: ``python -m torch.distributed.run ... test_fsdp_distributed.py MODE ARGS OUT``.
Mode ``checks`` runs several two-rank checks and records each one's outcome in ``OUT/results.json``; mode
``train`` trains one rollout under three micro-batch settings and saves the resulting weights, so the tests can
compare 2 ranks against 1 rank and micro-batch settings against each other.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import random
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# (prompt length, response length) of 5 samples per rank, different on each rank
SHAPES = [[(3, 2), (5, 7), (1, 4), (8, 1), (2, 9)], [(4, 4), (6, 3), (2, 2), (7, 5), (1, 1)]]
TRAIN_CONFIGS = {
    "mbs1": dict(micro_batch_size=1),
    "mbs4": dict(micro_batch_size=4),
    "dynamic": dict(use_dynamic_batch_size=True, max_tokens_per_gpu=24),
}


# ---------------------------------------------------------------------------------------------- the worker
def _samples(shapes, seed: int, rewards=None):
    from vime.utils.types import Sample, Status

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(shapes):
        tokens = torch.randint(4, 61, (p + r,), generator=g).tolist()
        reward = float(rewards[i]) if rewards is not None else float(torch.rand((), generator=g) > 0.5)
        out.append(Sample(index=i, tokens=tokens, response_length=r, reward=reward, status=Status.COMPLETED))
    return out


def _full_params(trainer) -> dict[str, torch.Tensor]:
    return {name: t.cpu().clone() for bucket in trainer.iter_weight_buckets(1 << 30) for name, t in bucket}


def check_log_probs(args, rank: int, out: Path) -> None:
    """Packed log-probs of 5 variable-length samples equal a plain transformers forward per sample."""
    from transformers import AutoModelForCausalLM

    from vime.backends.fsdp_utils.trainer import FSDPTrainer

    trainer = FSDPTrainer(_with(args, micro_batch_size=5))  # one packed row of 5 samples
    samples = _samples(SHAPES[rank], seed=rank)
    got = trainer.compute_log_probs(samples)
    reference = AutoModelForCausalLM.from_pretrained(args.hf_checkpoint, dtype=torch.float32)
    with torch.no_grad():
        for s, lp in zip(samples, got, strict=True):
            logits = reference(torch.tensor([s.tokens])).logits[0]
            positions = torch.arange(s.prompt_length - 1, len(s.tokens) - 1)
            want = torch.log_softmax(logits, -1)[positions, torch.tensor(s.tokens[s.prompt_length :])]
            diff = (lp - want).abs().max().item()
            assert diff < 1e-5, f"rank {rank} sample {s.index}: max |diff| {diff}"


def check_normalize_advantages(args, rank: int, out: Path) -> None:
    """Whitening over the data-parallel batch equals whitening the concatenation of both ranks' tokens."""
    from vime.utils.ppo_utils import masked_whiten
    from vime.utils.train_data import normalize_advantages

    data = {r: torch.arange(3 + r, dtype=torch.float32) * (r + 1) for r in range(2)}  # lengths 3 and 4
    masks = {r: torch.tensor([1.0, 0.0, 1.0, 1.0][: 3 + r]) for r in range(2)}
    got = torch.cat(
        normalize_advantages([data[rank][:2], data[rank][2:]], [masks[rank][:2], masks[rank][2:]])
    )
    everything = masked_whiten(torch.cat([data[0], data[1]]), torch.cat([masks[0], masks[1]]))
    mine = everything[:3] if rank == 0 else everything[3:]
    torch.testing.assert_close(got, mine * masks[rank])


def check_buckets_and_export(args, rank: int, out: Path) -> None:
    """Buckets hold every HF name once with full shapes, within the byte limit; the HF export matches them."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from vime.backends.fsdp_utils.trainer import FSDPTrainer

    trainer = FSDPTrainer(args)
    samples = _samples(SHAPES[rank][:4], seed=10 + rank)
    trainer.train(0, samples, [1.0, -1.0, 0.5, -0.5])
    limit = 40_000
    buckets = list(trainer.iter_weight_buckets(limit))
    with safe_open(Path(args.hf_checkpoint) / "model.safetensors", "pt") as f:
        hf_shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    names = [n for b in buckets for n, _ in b]
    assert sorted(names) == sorted(hf_shapes) and len(names) == len(set(names)), names
    for bucket in buckets:
        assert len(bucket) == 1 or sum(t.numel() * t.element_size() for _, t in bucket) <= limit
        assert all(tuple(t.shape) == hf_shapes[n] for n, t in bucket)
    trainer.export_hf(str(out / "hf"))
    if rank == 0:
        exported = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).state_dict()
        for name, tensor in (pair for b in buckets for pair in b):
            assert torch.equal(exported[name], tensor.cpu()), name


def check_resume(args, rank: int, out: Path) -> None:
    """Sharded save at rollout 0, resume in a fresh trainer: rollout 1 gives bit-identical weights."""
    from vime.backends.fsdp_utils.trainer import FSDPTrainer

    ckpt = str(out / "ckpt")
    args = _with(
        args, optimizer="adam", lr=1e-2, lr_decay_style="cosine", lr_warmup_iters=1, min_lr=1e-3,
        use_kl_loss=True, kl_loss_coef=0.1, save=ckpt, load=ckpt,
    )  # fmt: skip
    samples = _samples(SHAPES[rank][:4], seed=20 + rank)
    rewards = [1.0, -1.0, 0.5, -0.5]
    first = FSDPTrainer(args)
    assert first.load() is None
    first.train(0, samples, rewards)
    first.save(0, ckpt)
    expected_rng = (torch.rand(2).tolist(), random.random(), float(np.random.rand()))
    first.train(1, samples, rewards)
    uninterrupted = _full_params(first)
    resumed = FSDPTrainer(args)
    assert resumed.load() == 0
    assert (torch.rand(2).tolist(), random.random(), float(np.random.rand())) == expected_rng, (
        "RNG not restored"
    )
    resumed.train(1, samples, rewards)
    for name, tensor in _full_params(resumed).items():
        assert torch.equal(tensor, uninterrupted[name]), name


CHECKS: dict[str, Callable] = {
    "log_probs": check_log_probs,
    "normalize_advantages": check_normalize_advantages,
    "buckets_and_export": check_buckets_and_export,
    "resume": check_resume,
}


def _with(args, **overrides):
    args = copy.deepcopy(args)
    vars(args).update(overrides)
    return args


def run_checks(args, rank: int, out: Path) -> None:
    results = {}
    for name, check in CHECKS.items():
        try:
            check(args, rank, out)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
            print(f"rank {rank} check {name} failed:\n{results[name]}", file=sys.stderr, flush=True)
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results))
    elif any(v != "ok" for v in results.values()):
        (out / "results_rank1.json").write_text(json.dumps(results))


def run_train(args, rank: int, out: Path) -> None:
    """Train the same 16-sample rollout (2 optimizer steps) under each micro-batch setting; save the weights."""
    import torch.distributed as dist

    from vime.backends.fsdp_utils.trainer import FSDPTrainer
    from vime.utils.train_data import shape_rewards, split_rollout

    rollout = _samples([(1 + i % 5, 1 + (7 * i) % 6) for i in range(16)], seed=99)
    groups = [rollout[i : i + 4] for i in range(0, 16, 4)]
    for name, overrides in TRAIN_CONFIGS.items():
        config = _with(args, **overrides)
        rewards = shape_rewards(config, groups)
        mine = split_rollout(
            [len(s.tokens) for s in rollout], dist.get_world_size(), config.global_batch_size
        )[rank]
        trainer = FSDPTrainer(config)
        metrics = trainer.train(0, [rollout[i] for i in mine], [rewards[i] for i in mine])
        params = _full_params(trainer)
        if rank == 0:
            torch.save({"params": params, "metrics": metrics}, out / f"{name}.pt")


def worker_main(mode: str, args_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from vime.utils.distributed import init_distributed

    init_distributed()
    rank = int(os.environ["RANK"])
    args = pickle.loads(Path(args_file).read_bytes())
    {"checks": run_checks, "train": run_train}[mode](args, rank, Path(out_dir))
    # both ranks are done before either tears gloo down (left to interpreter exit, a rank could abort:
    # "terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()
    # and no interpreter teardown at all: a rank still aborted there once in CI with the same message, after its
    # results were written (a joinable C++ thread destroyed at exit); the results files are the outcome
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------------------------- the tests
def _launch(nproc: int, mode: str, args, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    args_file = out / "args.pkl"
    args_file.write_bytes(pickle.dumps(args))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           __file__, mode, str(args_file), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (
        f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )


@pytest.fixture(scope="module")
def fsdp_args(tiny_model_dir):
    from vime.utils.arguments import parse_args

    return parse_args(
        [
            "--train-backend", "fsdp", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", "unused.jsonl",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-rollout", "1",
            "--lr", "1e-3", "--weight-decay", "0", "--micro-batch-size", "2",
        ]
    )  # fmt: skip


@pytest.fixture(scope="module")
def check_results(fsdp_args, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("fsdp_checks")
    _launch(2, "checks", fsdp_args, out)
    results = json.loads((out / "results.json").read_text())
    if (out / "results_rank1.json").exists():
        rank1 = json.loads((out / "results_rank1.json").read_text())
        results = {k: v if v != "ok" else rank1[k] for k, v in results.items()}
    return results


@pytest.mark.e2e
@pytest.mark.parametrize("check", list(CHECKS))
def test_two_rank_check(check_results, check):
    assert check_results[check] == "ok", check_results[check]


@pytest.mark.e2e
def test_two_ranks_and_micro_batching_give_the_same_update(fsdp_args, tmp_path):
    # SGD: the update is the gradient itself (Adam's first step ~ lr * sign(grad) amplifies rounding noise).
    args = copy.deepcopy(fsdp_args)
    vars(args).update(optimizer="sgd", lr=0.1, global_batch_size=8, num_steps_per_rollout=2)
    for nproc in (1, 2):
        _launch(nproc, "train", args, tmp_path / f"dp{nproc}")
    reference = torch.load(tmp_path / "dp1" / "mbs1.pt")
    for nproc in (1, 2):
        for name in TRAIN_CONFIGS:
            result = torch.load(tmp_path / f"dp{nproc}" / f"{name}.pt")
            for key, tensor in reference["params"].items():
                torch.testing.assert_close(result["params"][key], tensor, rtol=1e-6, atol=1e-8)
            assert result["metrics"]["grad_norm"] == pytest.approx(
                reference["metrics"]["grad_norm"], rel=1e-5
            )
            assert result["metrics"]["pg_loss"] == pytest.approx(reference["metrics"]["pg_loss"], abs=1e-6)


if __name__ == "__main__":
    worker_main(*sys.argv[1:])
