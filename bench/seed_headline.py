"""The seeds' headline workload: colocated GRPO of a Qwen3-30B-A3B-shaped MoE with slime's
``scripts/run-qwen3-30B-A3B.sh`` settings, timed per step (rollout / train / sync / offload), through ``train.py``.

The model is random-init (``bench/shapes.py``: Qwen3-30B-A3B's layer, 128 experts top-8, ``--num-layers`` of its
48 layers, Qwen3's 151,936-token vocabulary). Responses ignore EOS and have lengths drawn per sample around
``--mean-response-len`` (``bench.fixed_length.generate_drawn_length``), so the work per step is known. Batch settings are slime's: 32
prompts x 8 samples, global batch 256 (one optimizer step per rollout), responses up to 8192 tokens, KL loss on
with coefficient 0 (so the reference model's forward runs), eps-clip 0.2/0.28, Adam lr 1e-6 with weight decay 0.1
and betas (0.9, 0.98), full recompute, ``--max-tokens-per-gpu 20480``, the engines at 0.7 of the GPU memory. On
``G`` GPUs the trainer runs TP=min(4, G) with sequence parallelism and EP=G, and one engine spans all G GPUs
(slime: TP 4, EP 8, one 8-GPU engine).

The engines run without vLLM's AllReduce+RMSNorm fusion (``--no-allreduce-rms-fusion``, the default here): for
TP > 1 on Hopper/Blackwell, vLLM 0.25 turns ``pass_config.fuse_allreduce_rms`` on (``config/vllm.py:128``), and its
pass builds two FlashInfer workspaces at compile time (``compilation/passes/fusion/allreduce_rms_fusion.py:1006,1013``):
one on the ``mnnvl`` backend, which needs NVLink multicast (barred on the lent GPU hosts), and an FP8/FP4 "quant"
one on ``trtllm`` that an unquantized model never uses. On 4 x H200 the second took 4 minutes of the engine's start
(16:54:52 -> 16:58:45 in its log), so the first step never finished inside a 10-minute call.

Start-up phases and each step are printed (``[bench]`` lines) as they happen, and the result JSON is rewritten after
every step (``"steps_done"``, ``"complete"``): a call cut off keeps what it measured. On the device machine pass
``--out "$OUT/<name>.json"`` so the file comes back even then.

    python bench/seed_headline.py --num-layers 4                   # 1 GPU, reduced
    python bench/seed_headline.py --num-layers 48 --gpus 8         # the headline run (8 x H200)
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
from bench.shapes import PEAK_BF16_FLOPS, build_shape, matmul_params, trainer_flags, write_result  # noqa: E402

SEED_STEP_S = {"8 x H200": 252.0, "8 x GB200": 147.0}  # the vime announcement's mean step times


def slime_argv(opts, model_dir: Path, work: Path) -> list[str]:
    """``train.py`` flags: slime's run-qwen3-30B-A3B.sh settings scaled to ``opts.gpus``."""
    tp = min(4, opts.gpus)
    argv = [sys.executable, str(REPO / "train.py"), *trainer_flags("megatron", model_dir)] + [
        "--prompt-data", str(model_dir / "train.jsonl"), "--rm-type", "exact",
        "--rollout-function-path", "bench.fixed_length.generate_rollout",
        "--custom-generate-function-path", "bench.fixed_length.generate_drawn_length",
        "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--global-batch-size", "256",
        "--rollout-max-response-len", str(opts.max_response_len), "--rollout-temperature", "1",
        "--num-rollout", str(opts.steps),
        "--actor-num-gpus-per-node", str(opts.gpus), "--colocate", "--offload",
        "--rollout-num-gpus-per-engine", str(opts.gpus_per_engine),
        "--vllm-gpu-memory-utilization", str(opts.gpu_memory_utilization),
        "--vllm-max-model-len", str(opts.max_response_len + 256),
        "--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size", str(opts.gpus),
        "--expert-tensor-parallel-size", "1",
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(opts.max_tokens_per_gpu),
        "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0", "--kl-loss-type", "low_var_kl",
        "--entropy-coef", "0", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
        "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.98",
        "--log-dir", str(work / "logs"),
    ]  # fmt: skip
    if tp > 1:
        argv.append("--sequence-parallel")
    if opts.grouped_gemm:
        argv.append("--moe-grouped-gemm")
    if not opts.cuda_graphs:
        argv.append("--vllm-enforce-eager")
    if not opts.allreduce_rms_fusion:
        argv += ["--vllm-compilation-config", json.dumps({"pass_config": {"fuse_allreduce_rms": False}})]
    return argv + opts.extra


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=48, help="of Qwen3-30B-A3B's 48")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument(
        "--gpus-per-engine", type=int, default=None,
        help="GPUs (tensor parallelism) of each engine; default all (one engine, as slime); 1: one engine per GPU",
    )  # fmt: skip
    p.add_argument("--mean-response-len", type=int, default=4096)
    p.add_argument("--max-response-len", type=int, default=8192)
    p.add_argument("--max-tokens-per-gpu", type=int, default=20480)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.7)
    p.add_argument("--steps", type=int, default=3, help="GRPO steps; the first is warm-up")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--grouped-gemm", action=argparse.BooleanOptionalAction, default=True, help="--moe-grouped-gemm"
    )
    p.add_argument(
        "--allreduce-rms-fusion",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="vLLM's pass_config.fuse_allreduce_rms (FlashInfer workspaces; see above); off unless given",
    )
    p.add_argument("--out", default=None, help="the result JSON (default bench/results/<name>.json)")
    p.add_argument("extra", nargs="*", help="more train.py flags, after --")
    opts = p.parse_args(argv)
    opts.gpus_per_engine = opts.gpus_per_engine or opts.gpus
    return opts


def result(
    opts,
    shape: str,
    model_dir: Path,
    figures: dict[str, float],
    steps: list[dict],
    peak_gib: float,
    wall: float,
) -> dict:
    """The result JSON of the steps so far (:func:`bench.grpo_step.read_steps`)."""
    generated = statistics.median(s.get("rollout/response_tokens", 0) for s in steps)
    train_tokens = figures.get("train/tokens_per_s", 0.0) * figures.get("train/step_time_s", 0.0)
    params = matmul_params(model_dir)
    # old-log-prob and reference forwards (2 + 2) plus forward/backward (6), per active parameter and token
    mfu = (
        10 * params * train_tokens / figures["time/train_s"] / (PEAK_BF16_FLOPS * opts.gpus)
        if train_tokens
        else None
    )
    step_s = figures["time/rollout_s"] + figures["time/train_s"] + figures["time/sync_s"]
    done = steps[-1]["rollout_id"] + 1
    return {
        "benchmark": "seed_headline",
        "workload": {
            "shape": shape,
            "gpus": opts.gpus,
            "gpus_per_engine": opts.gpus_per_engine,
            "prompts": 32,
            "n_samples_per_prompt": 8,
            "global_batch": 256,
            "mean_response_len": opts.mean_response_len,
            "max_response_len": opts.max_response_len,
            "max_tokens_per_gpu": opts.max_tokens_per_gpu,
            "cuda_graphs": opts.cuda_graphs,
            "allreduce_rms_fusion": opts.allreduce_rms_fusion,
            "vllm_gpu_memory_utilization": opts.gpu_memory_utilization,
            "active_matmul_params": params,
            "extra": opts.extra,
        },  # fmt: skip
        "steps_done": done,
        "complete": done == opts.steps,
        "seed_step_s": SEED_STEP_S,
        "step_s": step_s,
        "generated_tok_per_s": generated / figures["time/rollout_s"] if generated else None,
        "train_tok_per_s": figures.get("train/tokens_per_s"),
        "train_mfu": mfu,
        "gpu_memory_peak_gib": peak_gib,
        "wall_s": wall,
        "median_of_steps": figures,
        "steps": steps,
        "summary": f"{shape} {opts.gpus} GPU(s), {done}/{opts.steps} steps: step {step_s:.1f} s = rollout "
        f"{figures['time/rollout_s']:.1f} + train {figures['time/train_s']:.1f} + sync {figures['time/sync_s']:.2f} "
        f"(offload {figures.get('time/offload_s', 0):.2f}, onload {figures.get('time/onload_s', 0):.2f}); "
        f"train MFU {mfu or 0:.0%}; GPU peak {peak_gib:.0f} GiB",
    }


def main() -> None:
    opts = parse_options()
    shape = f"30b-a3b-{opts.num_layers}l"
    model_dir = build_shape(shape, max_position_embeddings=opts.max_response_len + 256)
    print(f"[bench] model ready: {model_dir}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="vime-headline-"))
    os.environ["VIME_BENCH_MEAN_RESPONSE_LEN"] = str(opts.mean_response_len)
    name = f"seed_headline_{shape}_{opts.gpus}gpu" + ("" if opts.grouped_gemm else "_sequential-experts")
    if opts.gpus_per_engine != opts.gpus:
        name += f"_tp{opts.gpus_per_engine}-engines"
    out = opts.out or f"bench/results/{name}.json"

    def write(*so_far) -> None:
        write_result(out, result(opts, shape, model_dir, *so_far))

    write(*run_steps(slime_argv(opts, model_dir, work), work, on_step=write))


if __name__ == "__main__":
    main()
