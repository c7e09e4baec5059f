"""Issue 12's R3 acceptance run: ``train_rollout_logprob_abs_diff`` per GRPO step of a Qwen3-30B-A3B-shaped MoE
(``bench/shapes.py``: its layer, 128 experts top-8, ``--num-layers`` of its 48), Megatron in bf16 with EP=2 on
2 GPUs (colocated with two vLLM engines, offloaded while they generate), with and without
``--use-rollout-routing-replay``, same seeds, through ``train.py``. The seeds report ~0.019 -> ~0.013 on the real
model; R3's diff must be the lower one.

One mode per call (each stays under the device machine's 10 minutes a command), then the comparison:

    bash bench/run.sh bench/r3_logprob_diff.py --mode baseline
    bash bench/run.sh bench/r3_logprob_diff.py --mode r3
    python bench/r3_logprob_diff.py --compare bench/results/r3_logprob_diff_30b-a3b-4l_{baseline,r3}.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # after PYTHONPATH

from bench.grpo_step import run_steps  # noqa: E402
from bench.shapes import build_shape, trainer_flags, write_result  # noqa: E402

METRIC = "train/train_rollout_logprob_abs_diff"


def train_argv(opts, model_dir: Path, work: Path) -> list[str]:
    argv = [sys.executable, str(REPO / "train.py"), *trainer_flags("megatron", model_dir)] + [
        "--prompt-data", str(model_dir / "train.jsonl"), "--rm-type", "exact",
        "--rollout-function-path", "bench.fixed_length.generate_rollout",
        "--custom-generate-function-path", "bench.fixed_length.generate_drawn_length",
        "--rollout-batch-size", str(opts.prompts), "--n-samples-per-prompt", str(opts.n_samples),
        "--rollout-max-response-len", str(opts.max_response_len), "--rollout-temperature", "1",
        "--num-rollout", str(opts.steps), "--seed", str(opts.seed), "--rollout-seed", str(opts.seed),
        "--actor-num-gpus-per-node", str(opts.gpus), "--colocate", "--offload",
        "--rollout-num-gpus-per-engine", "1",
        "--vllm-gpu-memory-utilization", str(opts.gpu_memory_utilization), "--vllm-enforce-eager",
        "--vllm-max-model-len", str(opts.max_response_len + 256),
        "--expert-model-parallel-size", str(opts.gpus), "--moe-token-dispatcher-type", "alltoall",
        "--moe-grouped-gemm", "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384",
        "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
        "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.98",
        "--log-dir", str(work / "logs"),
    ]  # fmt: skip
    if opts.mode == "r3":
        argv.append("--use-rollout-routing-replay")
    return argv + opts.extra


def compare(paths: list[str]) -> None:
    """Print the per-step diffs of two or more result files side by side, and which mode is lower."""
    runs = {
        json.loads(Path(p).read_text())["workload"]["mode"]: json.loads(Path(p).read_text()) for p in paths
    }
    steps = max(len(r["diff_per_step"]) for r in runs.values())
    print("step  " + "  ".join(f"{mode:>10}" for mode in runs))
    for step in range(steps):
        row = [
            r["diff_per_step"][step] if step < len(r["diff_per_step"]) else float("nan")
            for r in runs.values()
        ]
        print(f"{step:>4}  " + "  ".join(f"{v:>10.5f}" for v in row))
    means = {mode: statistics.mean(r["diff_per_step"]) for mode, r in runs.items()}
    print("mean  " + "  ".join(f"{means[mode]:>10.5f}" for mode in runs))
    if {"baseline", "r3"} <= set(means):
        lower = means["r3"] < means["baseline"]
        print(f"[bench] R3 mean diff {means['r3']:.5f} vs {means['baseline']:.5f} without: R3 is "
              f"{'lower' if lower else 'NOT lower'} ({means['r3'] / means['baseline']:.2f}x)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["baseline", "r3"], default="r3")
    p.add_argument("--compare", nargs="+", default=None, help="result files to print side by side, then exit")
    p.add_argument("--num-layers", type=int, default=4, help="of Qwen3-30B-A3B's 48")
    p.add_argument("--gpus", type=int, default=2, help="training ranks = EP size = engines")
    p.add_argument("--steps", type=int, default=21, help="GRPO steps (all reported)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n-samples", type=int, default=8)
    p.add_argument("--mean-response-len", type=int, default=512)
    p.add_argument("--max-response-len", type=int, default=1024)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None)
    p.add_argument("extra", nargs="*", help="more train.py flags, after --")
    opts = p.parse_args()
    if opts.compare:
        compare(opts.compare)
        return

    shape = f"30b-a3b-{opts.num_layers}l"
    model_dir = build_shape(shape, max_position_embeddings=opts.max_response_len + 256)
    work = Path(tempfile.mkdtemp(prefix=f"vime-r3-{opts.mode}-"))
    os.environ["VIME_BENCH_MEAN_RESPONSE_LEN"] = str(opts.mean_response_len)
    figures, _, peak_gib, wall = run_steps(train_argv(opts, model_dir, work), work)
    records = [json.loads(line) for line in (work / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if METRIC in r]
    diffs = [r[METRIC] for r in steps]
    name = f"r3_logprob_diff_{shape}_{opts.mode}"
    write_result(
        opts.out or f"bench/results/{name}.json",
        {
            "benchmark": "r3_logprob_diff",
            "workload": {
                "shape": shape,
                "mode": opts.mode,
                "gpus": opts.gpus,
                "expert_parallel": opts.gpus,
                "prompts": opts.prompts,
                "n_samples_per_prompt": opts.n_samples,
                "mean_response_len": opts.mean_response_len,
                "max_response_len": opts.max_response_len,
                "seed": opts.seed,
                "precision": "bf16",
                "extra": opts.extra,
            },  # fmt: skip
            "diff_per_step": diffs,
            "rollout_ids": [r.get("rollout_id") for r in steps],
            "mean_diff": statistics.mean(diffs),
            "gpu_memory_peak_gib": peak_gib,
            "wall_s": wall,
            "median_of_steps": figures,
            "summary": f"{name}: {len(diffs)} steps, train_rollout_logprob_abs_diff mean {statistics.mean(diffs):.5f} "
            f"(first {diffs[0]:.5f}, last {diffs[-1]:.5f}); {wall:.0f} s",
        },
    )


if __name__ == "__main__":
    main()
