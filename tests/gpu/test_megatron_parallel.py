"""TP=2 (with and without sequence parallelism), EP=2, PP=2, CP=2 and activation recompute give the same
log-probs, HF export and SGD step as TP=1 (Qwen3 dense and MoE, DeepSeek-V3's MLA MoE), on 2 GPUs (``VIME_PARALLEL_GPUS=4`` adds TP=2 + SP with CP=2). The
pytest test launches this file under ``torchrun``; the ``__main__`` part is the per-rank worker."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GPUS = int(os.environ.get("VIME_PARALLEL_GPUS", "2"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < GPUS, reason=f"needs {GPUS} CUDA GPUs"
    ),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]


def test_tp2_ep2_pp2_match_tp1(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_megatron_gpu import build_dense, build_family, build_moe

    build_dense(tmp_path / "dense")
    build_moe(tmp_path / "moe")
    build_family(tmp_path / "deepseek_v3", "deepseek_v3", num_layers=4)  # PP=2: two layers per stage
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = ["torchrun", "--nproc-per-node", str(GPUS), "--master-port", "29517", __file__, str(tmp_path)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500)
    print(result.stdout[-6000:])
    assert result.returncode == 0, result.stderr[-6000:]
    assert "ALL PARALLEL CHECKS PASSED" in result.stdout


def _worker(root: Path) -> None:
    import torch.distributed as dist
    from parallel_groups import release_model_parallel
    from test_megatron_gpu import make_args, mean_abs_diff, samples_for_test

    from vime.backends.megatron_utils.trainer import MegatronTrainer

    samples = samples_for_test()
    rank = int(os.environ["RANK"])
    results = {}
    cases = [
        ("dense", "tp1", []),
        ("dense", "tp2", ["--tensor-model-parallel-size", "2"]),
        ("moe", "tp1", []),
        ("moe", "tp2", ["--tensor-model-parallel-size", "2"]),
        ("moe", "ep2", ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]),
        ("moe", "tp2-etp1", ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]),
        ("dense", "pp2", ["--pipeline-model-parallel-size", "2"]),
        ("moe", "pp2", ["--pipeline-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]),
        ("dense", "recompute", ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                "--recompute-num-layers", "1"]),
        ("moe", "recompute", ["--recompute-granularity", "selective"]),
        ("dense", "tp2-sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("moe", "tp2-sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("dense", "cp2", ["--context-parallel-size", "2"]),
        ("moe", "cp2", ["--context-parallel-size", "2"]),
        # the critic (value head, value loss): "log-probs" below are its values
        ("dense-critic", "tp1", []),
        ("dense-critic", "tp2-sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("dense-critic", "cp2", ["--context-parallel-size", "2"]),
        ("dense-critic", "pp2", ["--pipeline-model-parallel-size", "2"]),
        # bf16 runs the flash kernels (fp32 the memory-efficient ones); forward only, looser tolerance
        ("dense-bf16", "tp1", []),
        ("dense-bf16", "cp2", ["--context-parallel-size", "2"]),
        ("dense-bf16", "tp2-sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        # multi-latent attention with DeepSeek's MoE (its expert bias frozen: a routing statistic, not trained)
        ("deepseek_v3", "tp1", []),
        ("deepseek_v3", "tp2-sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("deepseek_v3", "ep2", ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]),
        ("deepseek_v3", "pp2", ["--pipeline-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]),
        ("deepseek_v3", "cp2", ["--context-parallel-size", "2"]),
    ]  # fmt: skip
    if GPUS >= 4:
        # TP=1 would be 4 data-parallel ranks, more than the 6 samples' micro-batches allow: the reference is PP=2
        # (equal to TP=1 to the bit on 2 GPUs). Sequences are padded to a multiple of 2 x CP x TP.
        alltoall = ["--moe-token-dispatcher-type", "alltoall"]
        cases = [
            case
            for kind in ("dense", "moe", "dense-critic")
            for case in (
                (kind, "tp1", ["--pipeline-model-parallel-size", "2", *alltoall]),
                (kind, "tp2-sp-cp2", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                      "--context-parallel-size", "2", *alltoall]),
            )
        ]  # fmt: skip
    if os.environ.get("VIME_PARALLEL_CASES"):  # e.g. "dense:tp2-sp,moe:cp2" (each kind's tp1 always runs)
        wanted = set(os.environ["VIME_PARALLEL_CASES"].split(","))
        cases = [c for c in cases if c[1] == "tp1" or f"{c[0]}:{c[1]}" in wanted]
    for kind, name, extra in cases:
        role = "critic" if kind.endswith("-critic") else "actor"
        bf16 = ["--bf16"] if kind.endswith("-bf16") else []
        frozen_bias = ["--moe-router-bias-update-rate", "0"] if kind == "deepseek_v3" else []
        config = make_args(
            root / kind.split("-")[0], "--actor-num-gpus-per-node", str(GPUS), "--optimizer", "sgd",
            "--lr", "0.1", "--advantage-estimator", "ppo" if role == "critic" else "grpo", *bf16, *frozen_bias,
            *extra,
        )  # fmt: skip
        trainer = MegatronTrainer(config, role=role)
        log_probs = (
            trainer.compute_values(samples) if role == "critic" else trainer.compute_log_probs(samples)
        )
        exported = {n: t.cpu() for b in trainer.iter_weight_buckets(1 << 20) for n, t in b}
        trained = None
        moe_tp_without_sp = (
            kind == "moe" and name.startswith("tp2") and "-sp" not in name
        )  # mcore refuses to train it
        if not bf16 and not moe_tp_without_sp:
            values = {"values": log_probs} if role == "critic" else {}
            metrics = trainer.train(0, samples, [1.0, -1.0] * 3, **values)
            if rank == 0:
                print(
                    f"[{kind} {name}] loss {metrics.get('loss')} grad norm {metrics['grad_norm']:.6e}",
                    flush=True,
                )
            trained = {n: t.cpu() for b in trainer.iter_weight_buckets(1 << 20) for n, t in b}
        results[(kind, name)] = (log_probs, exported, trained)
        del trainer
        release_model_parallel()
        # each case used to leave ~7 GiB of NCCL buffers behind, until a late one ran out of memory: show what is left
        if rank == 0:
            free, total = torch.cuda.mem_get_info()
            print(f"[{kind} {name}] left {torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved by torch, "
                  f"{(total - free) / 2**30:.2f} GiB used on the device", flush=True)  # fmt: skip
    failures = []
    for kind, name, _ in cases:
        if name == "tp1":
            continue
        base_lp, base_w, base_t = results[(kind, "tp1")]
        lp, w, t = results[(kind, name)]
        step_diff, worst_tensor = (
            max((float((t[n] - base_t[n]).abs().max()), n) for n in base_t) if t is not None else (None, None)
        )
        if rank == 0 and t is not None:
            print(
                f"[{kind} {name} vs tp1] one SGD step: largest updated-weight diff {step_diff:.3e} ({worst_tensor})",
                flush=True,
            )
        if t is not None and not step_diff <= 1e-5:
            failures.append((kind, name, "train step", step_diff, worst_tensor))
        diff = mean_abs_diff(lp, base_lp)
        worst = max(float((a - b).abs().max()) for a, b in zip(lp, base_lp, strict=True))
        same_weights = sorted(w) == sorted(base_w) and all(torch.equal(w[n], base_w[n]) for n in base_w)
        if rank == 0:
            print(f"[{kind} {name} vs tp1] log-probs mean |diff| {diff:.3e} max {worst:.3e}; "
                  f"HF export identical: {same_weights}", flush=True)  # fmt: skip
        close = diff <= 2e-3 and worst <= 5e-2 if kind.endswith("-bf16") else diff <= 1e-5 and worst <= 1e-4
        if not (close and same_weights):  # also catches nan
            failures.append((kind, name, diff, worst, same_weights))
    dist.barrier()
    if failures:
        raise SystemExit(f"rank {rank}: {failures}")
    if rank == 0:
        print("ALL PARALLEL CHECKS PASSED", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
