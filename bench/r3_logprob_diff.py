"""Issue 12/23's R3 acceptance run: ``train_rollout_logprob_abs_diff`` per GRPO step of a Qwen3-30B-A3B-shaped MoE
(``bench/shapes.py``: its layer, 128 experts top-8, ``--num-layers`` of its 48, Qwen3's 151,936-token vocabulary),
Megatron in bf16 with EP over ``--gpus`` GPUs (colocated with one vLLM engine per GPU, offloaded while they
generate), with and without ``--use-rollout-routing-replay``, same seeded model and prompts, through ``train.py``.
The seeds report ~0.019 -> ~0.013 on the real model; R3's diff must be the lower one. The R3 run also scores every
batch with the trainer's own routing (``--log-logprob-diff-without-replay``): the paired diff without replay.

Each step prints a ``[bench]`` line and rewrites the result JSON (and a copy under ``$OUT``), so a call cut short
still returns every finished step. A mode that does not fit one call resumes: its state (logs, a checkpoint every
``--save-interval`` steps) stays in ``--state-dir`` while the machine is warm, and the same command run again loads
the last checkpoint and goes on; ``--time-limit-s`` stops ``train.py`` (SIGINT) before the call's limit.

    bash bench/run.sh bench/r3_logprob_diff.py --mode baseline    # 4 GPUs; again if it stopped before 20 steps
    bash bench/run.sh bench/r3_logprob_diff.py --mode r3
    python bench/r3_logprob_diff.py --compare bench/results/r3_logprob_diff_30b-a3b-4l_4gpu_{baseline,r3}.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # after PYTHONPATH

from bench.grpo_step import gpu_memory_peak  # noqa: E402
from bench.shapes import build_shape, trainer_flags, write_result  # noqa: E402

METRIC = "train/train_rollout_logprob_abs_diff"
PAIRED = "train/train_rollout_logprob_abs_diff_without_replay"
STEP_TIMES = ["time/rollout_s", "time/train_s", "time/sync_s"]


def train_argv(opts, model_dir: Path, state: Path, load: bool) -> list[str]:
    argv = [sys.executable, str(REPO / "train.py"), *trainer_flags("megatron", model_dir)] + [
        "--prompt-data", str(model_dir / "train.jsonl"),
        "--custom-rm-path", "bench.fixed_length.last_token_parity",
        "--rollout-function-path", "bench.fixed_length.generate_rollout",
        "--custom-generate-function-path", "bench.fixed_length.generate_drawn_length",
        "--rollout-batch-size", str(opts.prompts), "--n-samples-per-prompt", str(opts.n_samples),
        "--rollout-max-response-len", str(opts.max_response_len), "--rollout-temperature", "1",
        "--num-rollout", str(opts.steps + 1), "--seed", str(opts.seed), "--rollout-seed", str(opts.seed),
        "--actor-num-gpus-per-node", str(opts.gpus), "--colocate", "--offload",
        "--rollout-num-gpus-per-engine", "1",
        "--vllm-gpu-memory-utilization", str(opts.gpu_memory_utilization), "--vllm-enforce-eager",
        "--vllm-max-model-len", str(opts.max_response_len + 256),
        "--expert-model-parallel-size", str(opts.gpus), "--moe-token-dispatcher-type", "alltoall",
        "--moe-grouped-gemm", "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(opts.max_tokens_per_gpu),
        "--log-probs-chunk-size", "2048",
        "--advantage-estimator", "grpo", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
        "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.98",
        "--log-dir", str(state / "logs"),
    ]  # fmt: skip
    if opts.save_interval:
        argv += ["--save", str(state / "ckpt"), "--save-interval", str(opts.save_interval)]
    if load:
        argv += ["--load", str(state / "ckpt")]
    if opts.mode == "r3":
        argv += ["--use-rollout-routing-replay", "--log-logprob-diff-without-replay"]
    return argv + opts.extra


def last_checkpoint(state: Path) -> int | None:
    tracker = state / "ckpt" / "latest_checkpointed_iteration.txt"
    return int(tracker.read_text().strip()) if tracker.exists() else None


def step_records(state: Path) -> list[dict]:
    """Each rollout's metrics, the last record of a rollout id winning (a resumed run redoes the steps after its
    checkpoint)."""
    path = state / "logs" / "metrics.jsonl"
    by_id = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if METRIC in record:
            by_id[record["rollout_id"]] = record
    return [by_id[i] for i in sorted(by_id)]


def write_state(opts, shape: str, state: Path, calls: list[dict], peak_gib: float) -> dict:
    """The result JSON of every step so far (also copied to ``$OUT``); returns it."""
    steps = [r for r in step_records(state) if r["rollout_id"] < opts.steps]  # not the unreported last one
    diffs = [r[METRIC] for r in steps]
    paired = [r[PAIRED] for r in steps if PAIRED in r]
    name = f"r3_logprob_diff_{shape}_{opts.gpus}gpu_{opts.mode}"
    mean = statistics.mean(diffs) if diffs else float("nan")
    summary = f"{name}: {len(diffs)}/{opts.steps} steps, train_rollout_logprob_abs_diff mean {mean:.5f}"
    if paired:
        summary += f" (same batches without replay {statistics.mean(paired):.5f})"
    result = {
        "benchmark": "r3_logprob_diff",
        "workload": {
            "shape": shape,
            "mode": opts.mode,
            "gpus": opts.gpus,
            "expert_parallel": opts.gpus,
            "engines": f"{opts.gpus} x TP1, eager, colocated",
            "prompts": opts.prompts,
            "n_samples_per_prompt": opts.n_samples,
            "mean_response_len": opts.mean_response_len,
            "max_response_len": opts.max_response_len,
            "max_tokens_per_gpu": opts.max_tokens_per_gpu,
            "seed": opts.seed,
            "precision": "bf16",
            "vocab_size": 151936,
            "extra": opts.extra,
        },  # fmt: skip
        "complete": len(diffs) == opts.steps,
        "rollout_ids": [r["rollout_id"] for r in steps],
        "diff_per_step": diffs,
        "diff_without_replay_per_step": paired,
        "mean_diff": mean,
        "mean_diff_without_replay": statistics.mean(paired) if paired else None,
        "step_times_s": {k: [r.get(k) for r in steps] for k in STEP_TIMES},
        "gpu_memory_peak_gib": peak_gib,
        "calls": calls,
        "summary": summary,
    }
    path = Path(opts.out or f"bench/results/{name}.json")
    write_result(path, result)
    if out := os.environ.get("OUT"):
        shutil.copy(path, Path(out) / path.name)
    return result


def run_train(opts, argv: list[str], log_path: Path, on_step) -> tuple[int, str | None]:
    """Run ``train.py``: every output line into ``log_path`` with the seconds since start, start-up and error lines
    on the console too (as ``[bench] +<s>s ...``), ``on_step()`` after each step's line. SIGINT once ``on_step``
    returns True (all steps done: ``train.py`` runs one rollout more than reported, so that its final checkpoint is
    never written) or at ``--time-limit-s``. Returns its exit code and why it was stopped (None: it ended)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)])),
    }
    started = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip

    stopped: list[str] = []

    def stop(reason: str) -> None:
        if stopped:
            return
        stopped.append(reason)
        print(f"[bench] {reason}: stopping train.py", flush=True)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)

    limit = f"--time-limit-s {opts.time_limit_s:g}"
    timer = threading.Timer(opts.time_limit_s, stop, [limit]) if opts.time_limit_s else None
    if timer:
        timer.daemon = True
        timer.start()
    with open(log_path, "a", encoding="utf-8") as log:
        for line in proc.stdout:
            stamped = f"+{time.monotonic() - started:6.1f}s {line}"
            log.write(stamped)
            log.flush()
            if line.startswith(("[vime]", "[rollout", "Traceback")) or "Error" in line:
                print(f"[bench] {stamped}", end="", flush=True)
            if line.startswith("[rollout") and on_step():
                threading.Thread(target=stop, args=["all steps done"], daemon=True).start()
    code = proc.wait()
    if timer:
        timer.cancel()
    return code, stopped[0] if stopped else None


def compare(paths: list[str]) -> None:
    """Print the per-step diffs of the result files side by side (R3's paired no-replay diff too), and whether R3
    is the lower one."""
    runs = {}
    for p in paths:
        r = json.loads(Path(p).read_text())
        runs[r["workload"]["mode"]] = r["diff_per_step"]
        if r.get("diff_without_replay_per_step"):
            runs[r["workload"]["mode"] + " w/o replay"] = r["diff_without_replay_per_step"]
    steps = max(len(d) for d in runs.values())
    print("step  " + "  ".join(f"{mode:>14}" for mode in runs))
    for step in range(steps):
        row = [d[step] if step < len(d) else float("nan") for d in runs.values()]
        print(f"{step:>4}  " + "  ".join(f"{v:>14.5f}" for v in row))
    means = {mode: statistics.mean(d) for mode, d in runs.items()}
    print("mean  " + "  ".join(f"{means[mode]:>14.5f}" for mode in runs))
    if {"baseline", "r3"} <= set(means):
        lower = means["r3"] < means["baseline"]
        print(f"[bench] R3 mean diff {means['r3']:.5f} vs {means['baseline']:.5f} without: R3 is "
              f"{'lower' if lower else 'NOT lower'} ({means['r3'] / means['baseline']:.2f}x)")  # fmt: skip
    if {"r3", "r3 w/o replay"} <= set(means):
        print(f"[bench] paired, same batches: R3 {means['r3']:.5f} vs {means['r3 w/o replay']:.5f} without replay "
              f"({means['r3'] / means['r3 w/o replay']:.2f}x)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["baseline", "r3"], default="r3")
    p.add_argument("--compare", nargs="+", default=None, help="result files to print side by side, then exit")
    p.add_argument("--num-layers", type=int, default=4, help="of Qwen3-30B-A3B's 48")
    p.add_argument("--gpus", type=int, default=4, help="training ranks = EP size = engines (one GPU each)")
    p.add_argument("--steps", type=int, default=20, help="GRPO steps (all reported)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n-samples", type=int, default=8)
    p.add_argument("--mean-response-len", type=int, default=256)
    p.add_argument("--max-response-len", type=int, default=512)
    p.add_argument("--max-tokens-per-gpu", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--save-interval", type=int, default=5, help="checkpoint every N steps, to resume (0: never)"
    )
    p.add_argument("--time-limit-s", type=float, default=0, help="stop train.py after this long (0: never)")
    p.add_argument(
        "--state-dir", default="/tmp/vime-r3", help="per-mode logs and checkpoints, kept to resume"
    )
    p.add_argument("--fresh", action="store_true", help="start over: drop this mode's state")
    p.add_argument("--out", default=None)
    p.add_argument("extra", nargs="*", help="more train.py flags, after --")
    opts = p.parse_args()
    if opts.compare:
        compare(opts.compare)
        return

    started = time.monotonic()
    shape = f"30b-a3b-{opts.num_layers}l"
    model_dir = build_shape(shape, max_position_embeddings=opts.max_response_len + 256)
    state = Path(opts.state_dir) / opts.mode
    if opts.fresh:
        shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True, exist_ok=True)
    calls_path = state / "calls.json"
    calls = json.loads(calls_path.read_text()) if calls_path.exists() else []
    resumed_from = last_checkpoint(state)
    if step_records(state) and resumed_from is None:
        raise SystemExit(f"{state} holds steps but no checkpoint to resume from: rerun with --fresh")
    call = {"resumed_from": resumed_from, "build_s": round(time.monotonic() - started, 1)}
    calls.append(call)
    print(f"[bench] {shape}: model ready in {call['build_s']:.0f} s; "
          f"{'resuming after rollout ' + str(resumed_from) if resumed_from is not None else 'fresh start'}",
          flush=True)  # fmt: skip
    os.environ["VIME_BENCH_MEAN_RESPONSE_LEN"] = str(opts.mean_response_len)
    stop, peak = threading.Event(), [0]
    poller = threading.Thread(target=gpu_memory_peak, args=(stop, peak), daemon=True)
    poller.start()
    launched = time.monotonic()

    def on_step() -> bool:
        call.setdefault("first_step_s", round(time.monotonic() - launched, 1))
        call["wall_s"] = round(time.monotonic() - started, 1)
        calls_path.write_text(json.dumps(calls))
        result = write_state(opts, shape, state, calls, peak[0] / 1024)
        last = result["diff_per_step"][-1]
        paired = result["diff_without_replay_per_step"]
        times = {k: v[-1] for k, v in result["step_times_s"].items()}
        print(f"[bench] step {result['rollout_ids'][-1]}: diff {last:.5f}"
              + (f" (without replay {paired[-1]:.5f})" if paired else "")
              + "; " + ", ".join(f"{k.split('/')[1]} {v:.1f}" for k, v in times.items() if v is not None),
              flush=True)  # fmt: skip
        return result["complete"]

    argv = train_argv(opts, model_dir, state, resumed_from is not None)
    code, stopped = run_train(opts, argv, state / "train.log", on_step)
    stop.set()
    call |= {
        "wall_s": round(time.monotonic() - started, 1),
        "exit_code": code,
        "stopped": stopped,
    }
    calls_path.write_text(json.dumps(calls))
    write_state(opts, shape, state, calls, peak[0] / 1024)
    if out := os.environ.get("OUT"):
        shutil.copy(state / "train.log", Path(out) / f"r3_{opts.mode}_train.log")
    if code and not stopped:
        raise SystemExit(f"train.py exited with {code}; its output: {state / 'train.log'}")


if __name__ == "__main__":
    main()
