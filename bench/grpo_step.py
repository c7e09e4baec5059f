"""A whole GRPO step of a realistic shape through ``train.py`` (Ray, vLLM + vllm-router, the trainer, weight sync):
the step's rollout / train / sync split, colocated on one GPU (engines asleep while the trainer trains, the
trainer offloaded while they generate) or split over two (engine on one GPU, trainer on the other).

Responses have a fixed length (``bench/fixed_length.py``), so every step does the same work; steps after the first
are reported (median), with the GPU memory peak seen by ``nvidia-smi``.

    python bench/grpo_step.py --shape 4b --layout colocate                 # 1 GPU
    python bench/grpo_step.py --shape 4b --layout split                    # 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # after PYTHONPATH

from bench.shapes import PEAK_BF16_FLOPS, build_shape, matmul_params, trainer_flags, write_result  # noqa: E402

REPORTED = [
    "time/rollout_s", "time/train_s", "time/sync_s", "time/onload_s", "time/offload_s", "offload/freed_gib",
    "weight_sync/gb_per_s", "rollout/tokens_per_s", "train/tokens_per_s", "train/step_time_s",
    "train/train_rollout_logprob_abs_diff",
    # issue 24's colocated target: the first wake call -> resume, then the KV cache's wake (after the offload)
    "weight_sync/weights_wake_s", "weight_sync/wake_to_resume_s", "weight_sync/kv_cache_wake_s",
    # the weights check (--check-weight-update-equal, on by default): its share of the step is read off these
    "weight_sync/checksum_s", "weight_sync/check_trainer_s", "weight_sync/check_s",
]  # fmt: skip
CHECK_PARTS = ["weight_sync/checksum_s", "weight_sync/check_trainer_s", "weight_sync/check_s"]
START_PHASE = re.compile(r"\[vime\] (.+ \d+ s after start)$")  # start_run's progress (vime/ray/run.py)
# the tracker's status line (vime/utils/tracking.py), printed once a step is logged
STEP_LINE = re.compile(r"\[rollout \d+(/\d+)?\]( |$)")


def gpu_memory_peak(stop: threading.Event, peak: list[int]) -> None:
    """Poll nvidia-smi for the most GPU memory in use on any GPU (MiB) until ``stop``."""
    while not stop.wait(0.5):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        used = [int(x) for x in out.stdout.split() if x.strip().isdigit()]
        if used:
            peak[0] = max(peak[0], *used)


def progress_line(line: str, elapsed_s: float) -> str | None:
    """The ``[bench]`` line reporting ``line`` of ``train.py``'s output if it marks progress (a start-up phase, or a
    step's status line), else None: ``bench/run.sh`` shows only ``[bench]`` lines, so a call cut off still says how
    far the run got."""
    line = line.rstrip("\n")
    if phase := START_PHASE.match(line):
        return f"[bench] {phase.group(1)}"
    if STEP_LINE.match(line):
        return f"[bench] {elapsed_s:.0f} s: {line}"
    return None


def read_steps(work: Path) -> tuple[dict[str, float], list[dict]]:
    """The median of :data:`REPORTED` over the steps logged so far after the first (the first alone while it is the
    only one), and those steps' metric records."""
    records = [json.loads(line) for line in (work / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/train_s" in r][1:] or [r for r in records if "time/train_s" in r]
    figures = {k: statistics.median(r[k] for r in steps) for k in REPORTED if all(k in r for r in steps)}
    return figures, steps


StepCallback = Callable[[dict[str, float], list[dict], float, float], None]


def run_steps(
    argv: list[str], work: Path, on_step: StepCallback | None = None
) -> tuple[dict[str, float], list[dict], float, float]:
    """Run ``train.py`` (``argv``, logging to ``work/logs``) and return :func:`read_steps`' figures and steps, the GPU
    memory peak (GiB) and the wall time (s). Its output passes through, with a :func:`progress_line` for each phase
    as it happens; after each step ``on_step`` gets the same four values so far."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)])),
    }
    stop, peak = threading.Event(), [0]
    poller = threading.Thread(target=gpu_memory_peak, args=(stop, peak), daemon=True)
    poller.start()
    started = time.monotonic()
    run = subprocess.Popen(
        argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        for line in run.stdout:
            print(line, end="", flush=True)
            if progress := progress_line(line, time.monotonic() - started):
                print(progress, flush=True)
                if on_step is not None and STEP_LINE.match(line):
                    on_step(*read_steps(work), peak[0] / 1024, time.monotonic() - started)
        if run.wait():
            raise subprocess.CalledProcessError(run.returncode, argv)
    finally:
        if run.poll() is None:  # an exception here (on_step's included) ends the run, as subprocess.run would
            run.kill()
            run.wait()
        stop.set()
        poller.join()
    return *read_steps(work), peak[0] / 1024, time.monotonic() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="4b")
    p.add_argument("--backend", choices=["megatron", "fsdp"], default="megatron")
    p.add_argument("--layout", choices=["colocate", "split"], default="colocate")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n-samples", type=int, default=8)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-tokens-per-gpu", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("extra", nargs="*", help="more train.py flags, after --")
    opts = p.parse_args()

    model_dir = build_shape(opts.shape)
    work = Path(tempfile.mkdtemp(prefix="vime-grpo-"))
    samples = opts.prompts * opts.n_samples
    argv = [sys.executable, str(REPO / "train.py"), *trainer_flags(opts.backend, model_dir)] + [
        "--prompt-data", str(model_dir / "train.jsonl"), "--rm-type", "exact",
        "--rollout-function-path", "bench.fixed_length.generate_rollout",
        "--rollout-batch-size", str(opts.prompts), "--n-samples-per-prompt", str(opts.n_samples),
        "--rollout-max-response-len", str(opts.response_len), "--num-rollout", str(opts.steps),
        "--global-batch-size", str(samples), "--lr", "1e-6",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(opts.max_tokens_per_gpu),
        "--log-dir", str(work / "logs"), "--vllm-enforce-eager",
        "--vllm-max-model-len", str(opts.response_len + 64),
    ]  # fmt: skip
    if opts.layout == "colocate":
        util = opts.gpu_memory_utilization or 0.7
        argv += ["--colocate", "--offload-train", "--vllm-gpu-memory-utilization", str(util)]
    else:
        util = opts.gpu_memory_utilization or 0.85
        argv += ["--update-weight-transport", "distributed", "--vllm-gpu-memory-utilization", str(util)]
    argv += opts.extra
    figures, steps, peak_gib, wall = run_steps(argv, work)
    step_s = figures["time/rollout_s"] + figures["time/train_s"] + figures["time/sync_s"]
    check_s = sum(figures.get(part, 0.0) for part in CHECK_PARTS)  # 0 with --no-check-weight-update-equal
    tokens = samples * opts.response_len
    params = matmul_params(model_dir)
    prompt_tokens = statistics.mean(
        len(json.loads(line)["prompt"]) for line in open(model_dir / "train.jsonl")
    )
    train_tokens = samples * (opts.response_len + prompt_tokens)
    mfu = 8 * params * train_tokens / figures["time/train_s"] / PEAK_BF16_FLOPS  # one training GPU either way
    name = f"grpo_step_{opts.backend}_{opts.shape}_{opts.layout}"
    write_result(
        opts.out or f"bench/results/{name}.json",
        {
            "benchmark": "grpo_step",
            "workload": {
                "shape": opts.shape,
                "backend": opts.backend,
                "layout": opts.layout,
                "prompts": opts.prompts,
                "n_samples_per_prompt": opts.n_samples,
                "response_len": opts.response_len,
                "vllm_gpu_memory_utilization": util,
                "cuda_graphs": False,
                "extra": opts.extra,
            },  # fmt: skip
            "step_s": step_s,
            "generated_tok_per_s": tokens / figures["time/rollout_s"],
            "train_mfu": mfu,
            "gpu_memory_peak_gib": peak_gib,
            "wall_s": wall,
            "weights_check_s": check_s,
            "weights_check_share_of_step": check_s / step_s,
            "median_of_steps": figures,
            "summary": f"{name}: step {step_s:.1f} s = rollout {figures['time/rollout_s']:.1f} + train "
            f"{figures['time/train_s']:.1f} + sync {figures['time/sync_s']:.2f} (weights check {check_s:.3f}, "
            f"{check_s / step_s:.2%} of the step; first wake -> resume "
            f"{figures.get('weight_sync/wake_to_resume_s', float('nan')):.3f} s, KV cache wake "
            f"{figures.get('weight_sync/kv_cache_wake_s', float('nan')):.3f} s); {tokens / figures['time/rollout_s']:,.0f} "
            f"generated tok/s, train MFU {mfu:.0%}, GPU peak {peak_gib:.0f} GiB",
        },
    )


if __name__ == "__main__":
    main()
