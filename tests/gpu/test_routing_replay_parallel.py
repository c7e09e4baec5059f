"""Routing replay under Megatron's parallelism, on 2 GPUs: with ``--use-rollout-routing-replay`` and experts the
model would not pick, EP=2, TP=2 + SP, CP=2, PP=2 and full recompute give the log-probs and the SGD step of TP=1
(so every rank's routers got the rows of its own tokens, and recompute inside backward got its own micro-batch);
``--use-routing-replay`` records the same routing under CP=2, TP=2 + SP and PP=2 as under TP=1 (the per-rank
recordings are gathered back to whole samples). The pytest test launches this file under ``torchrun``; the
``__main__`` part is the per-rank worker. Run: ``python3 -m pytest -q -s tests/gpu/test_routing_replay_parallel.py``
on ``nvidia-h200-x2`` (megatron-core installed, tests/gpu/README.md)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]

ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
CASES = [  # (name, flags); "tp1" is the reference of each mode
    ("tp1", []),
    ("ep2", ["--expert-model-parallel-size", "2", *ALLTOALL]),
    ("tp2-sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("cp2", ["--context-parallel-size", "2"]),
    ("pp2", ["--pipeline-model-parallel-size", "2", *ALLTOALL]),
    ("recompute", ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
]  # fmt: skip


def test_routing_replay_is_the_same_under_every_parallelism(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_megatron_gpu import build_moe

    build_moe(tmp_path / "moe")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = ["torchrun", "--nproc-per-node", "2", "--master-port", "29519", __file__, str(tmp_path)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=580)
    print(result.stdout[-6000:])
    assert result.returncode == 0, result.stderr[-6000:]
    assert "ALL ROUTING REPLAY CHECKS PASSED" in result.stdout


def _worker(root: Path) -> None:
    import torch.distributed as dist
    from parallel_groups import release_model_parallel
    from test_megatron_gpu import make_args, mean_abs_diff, samples_for_test
    from test_routing_replay_gpu import hf_model, other_experts, own_routing

    from vime.backends.megatron_utils.trainer import MegatronTrainer

    rank = int(os.environ["RANK"])
    model_dir = str(root / "moe")
    samples = samples_for_test()
    reference = hf_model(model_dir)
    for s in samples:
        s.rollout_routed_experts = other_experts(own_routing(reference, s.tokens))[:-1]
    del reference
    failures, results, recorded = [], {}, {}
    for mode in ("free", "r3", "record"):
        flag = {"free": [], "r3": ["--use-rollout-routing-replay"], "record": ["--use-routing-replay"]}[mode]
        for name, extra in CASES if mode != "free" else CASES[:1]:
            if mode == "record" and name in ("ep2", "recompute"):
                continue  # nothing of the token layout changes
            config = make_args(
                model_dir,
                "--actor-num-gpus-per-node",
                "2",
                "--optimizer",
                "sgd",
                "--lr",
                "0.1",
                *flag,
                *extra,
            )
            trainer = MegatronTrainer(config)
            log_probs = trainer.compute_log_probs(samples)
            if mode == "record":
                recorded[name] = {key: route.clone() for key, route in trainer.routing._recorded.items()}
                recorded[name, "layers"] = sorted(trainer.routing.replay.layers)  # a pipeline stage: its own
            metrics = trainer.train(
                0, samples, [1.0, -1.0] * 3, log_probs=log_probs if mode == "record" else None
            )
            trained = {n: t.cpu() for b in trainer.iter_weight_buckets(1 << 20) for n, t in b}
            results[mode, name] = (log_probs, trained)
            if rank == 0:
                print(
                    f"[{mode} {name}] loss {metrics.get('loss')} grad norm {metrics['grad_norm']:.6e}",
                    flush=True,
                )
            del trainer
            release_model_parallel()

    forced_vs_free = mean_abs_diff(results["r3", "tp1"][0], results["free", "tp1"][0])
    if rank == 0:
        print(f"[r3 tp1 vs free tp1] log-probs mean |diff| {forced_vs_free:.3e} (forced experts must matter)")
    if not forced_vs_free > 1e-3:
        failures.append(("r3 changes nothing", forced_vs_free))
    for mode in ("r3", "record"):
        base_lp, base_w = results[mode, "tp1"]
        for name, _ in CASES[1:]:
            if (mode, name) not in results:
                continue
            lp, w = results[mode, name]
            diff = mean_abs_diff(lp, base_lp)
            worst = max(float((a - b).abs().max()) for a, b in zip(lp, base_lp, strict=True))
            step = max(float((w[n] - base_w[n]).abs().max()) for n in base_w)
            if rank == 0:
                print(f"[{mode} {name} vs tp1] log-probs mean |diff| {diff:.3e} max {worst:.3e}; "
                      f"largest updated-weight diff {step:.3e}", flush=True)  # fmt: skip
            if not (diff <= 1e-5 and worst <= 1e-4 and step <= 1e-5):
                failures.append((mode, name, diff, worst, step))
    for name, _ in CASES[1:]:
        if name not in recorded:
            continue
        layers = recorded[name, "layers"]
        same = all(
            torch.equal(route[:, layers], recorded["tp1"][key][:, layers])
            for key, route in recorded[name].items()
        )
        if rank == 0:
            print(f"[record {name} vs tp1] recorded routing of layers {layers} identical: {same}", flush=True)
        if not same or len(recorded[name]) != len(samples):
            failures.append(("record", name, same, len(recorded[name])))
    dist.barrier()
    if failures:
        raise SystemExit(f"rank {rank}: {failures}")
    if rank == 0:
        print("ALL ROUTING REPLAY CHECKS PASSED", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
