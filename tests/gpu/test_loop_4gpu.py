"""Issue 23 item 3: the whole GRPO loop with engines of TP > 1 and trainers sharded across GPUs, on a tiny MoE
(8 experts top-2, 4 attention and 4 KV heads, fp32) and the quick start's add3 task. The cases a machine runs follow
its GPU count:

- 2 GPUs (``nvidia-h100-x2`` / ``nvidia-h200-x2``), one engine of TP=2 on both GPUs, CUDA IPC sync:
  ``megatron-ep2-colocate`` (2 Megatron ranks, EP=2), ``megatron-tp2-colocate`` (TP=2 + SP),
  ``fsdp2-colocate`` (2 FSDP ranks);
- 4 GPUs (``nvidia-h100-x4`` / ``nvidia-h200-x4``): ``megatron-ep4-colocate`` (EP=4, two TP=2 engines),
  ``megatron-tp2-ep2-colocate`` (TP=2 + SP x EP=2, the same engines), ``megatron-split`` (2 trainer ranks with EP=2
  on GPUs 0-1, one TP=2 engine on GPUs 2-3, NCCL sync), ``fsdp4-colocate`` (4 FSDP ranks, one TP=4 engine).

Each runs 20 steps. Bars (the issue's): the mean reward of steps 16-20 beats steps 1-5 by 0.1, and the mean
train-rollout log-prob difference is at most 1.5x the one-GPU run's (``test_one_gpu_reference``: the same model,
seed and flags on one GPU, one TP=1 engine, colocated), measured on the same machine: a case runs its backend's
reference first unless this machine already has it (``$VIME_LOOP_REFERENCE_DIR``, default under /tmp).

Each run writes ``loop_<case>.json`` (diffs, rewards, step times, the card) into ``$OUT`` when set, also when it
fails; ``$VIME_CALL_DEADLINE`` (epoch seconds) caps every run so that a device call ends with its logs. Needs the
GPU kit (tests/gpu/README.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
NUM_ROLLOUT = 20
DIFF_RATIO = 1.5  # the bar against the one-GPU run
REFERENCE_DIR = Path(os.environ.get("VIME_LOOP_REFERENCE_DIR", "/tmp/vime-loop-reference"))
RUN_TIMEOUT_S = 540
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in ("vllm", "ray", "vllm_router")),
        reason="needs vllm, ray and vllm-router (the GPU kit)",
    ),
]
MODEL = dict(
    num_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4, hidden_size=256
)
# (GPUs, layout flags); every case and the reference share the rest of the flags (_argv)
CASES = {
    "megatron-ep2-colocate": (2, [
        "--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus-per-engine", "2",
        "--expert-model-parallel-size", "2",
    ]),
    "megatron-tp2-colocate": (2, [
        "--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus-per-engine", "2",
        "--tensor-model-parallel-size", "2", "--sequence-parallel",
    ]),
    "fsdp2-colocate": (2, ["--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus-per-engine", "2"]),
    "megatron-ep4-colocate": (4, [
        "--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus-per-engine", "2",
        "--expert-model-parallel-size", "4",
    ]),
    "megatron-tp2-ep2-colocate": (4, [
        "--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus-per-engine", "2",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
    ]),
    "megatron-split": (4, [
        "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2",
        "--expert-model-parallel-size", "2", "--update-weight-transport", "distributed",
    ]),
    "fsdp4-colocate": (4, ["--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus-per-engine", "4"]),
}  # fmt: skip
REFERENCE = ["--colocate", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus-per-engine", "1"]


def _needs(backend: str) -> None:
    if backend == "megatron" and importlib.util.find_spec("megatron") is None:
        pytest.skip("needs megatron-core")


def _argv(backend: str, model_dir: Path, log_dir: Path, layout: list[str]) -> list[str]:
    argv = [
        sys.executable, str(REPO / "train.py"), "--train-backend", backend, "--hf-checkpoint", str(model_dir),
        "--prompt-data", str(model_dir / "train.jsonl"), "--rollout-shuffle", "--rm-type", "exact",
        "--rollout-batch-size", "16", "--n-samples-per-prompt", "16", "--rollout-max-response-len", "1",
        "--num-rollout", str(NUM_ROLLOUT), "--lr", "1e-3", "--weight-decay", "0",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--log-dir", str(log_dir),
        "--vllm-enforce-eager", "--vllm-dtype", "float32", "--vllm-max-model-len", "64",
        "--vllm-gpu-memory-utilization", "0.3", *layout,
    ]  # fmt: skip
    if backend == "megatron":
        from vime.backends.megatron_utils.hf_config import flags_from_hf_config, flags_to_argv, load_hf_config

        argv += flags_to_argv(flags_from_hf_config(load_hf_config(model_dir)))
    return argv


def _tail(path: Path, lines: int) -> str:
    return f"\n== {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _log_tails(log_dir: Path) -> str:
    """The end of train.py's output and of every engine and router log (for failures on the remote machine)."""
    logs = sorted(log_dir.glob("*.log"))
    return "".join(_tail(log, 60 if log.name == "train.log" else 25) for log in logs)


def _timeout_s() -> float:
    """This run's time limit: RUN_TIMEOUT_S, cut to end 20 s before ``$VIME_CALL_DEADLINE``."""
    deadline = os.environ.get("VIME_CALL_DEADLINE")
    left = float(deadline) - time.time() - 20 if deadline else RUN_TIMEOUT_S
    if left < 60:
        pytest.skip(f"{left:.0f} s left before $VIME_CALL_DEADLINE: too little for a run")
    return min(RUN_TIMEOUT_S, left)


def _stop(proc: subprocess.Popen) -> None:
    """End train.py and its process group (its local Ray dies with it: vime.utils.reaper), gently first."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _summary(name: str, backend: str, gpus: int, log_dir: Path) -> dict:
    """What one run logged: per-step diffs, rewards and times, and their summaries."""
    path = log_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    train = [r for r in records if "rollout/reward_mean" in r]
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in train]
    rewards = [r["rollout/reward_mean"] for r in train]
    later = train[1:]  # the first step also compiles and warms up
    return {
        "case": name,
        "backend": backend,
        "gpus": gpus,
        "card": torch.cuda.get_device_name(0),
        "visible_gpus": torch.cuda.device_count(),
        "steps": [r["rollout_id"] for r in train],
        "diffs": diffs,
        "diff_mean": sum(diffs) / len(diffs) if diffs else None,
        "diff_max": max(diffs) if diffs else None,
        "rewards": rewards,
        "reward_first5": sum(rewards[:5]) / 5 if len(rewards) >= 5 else None,
        "reward_last5": sum(rewards[-5:]) / 5 if len(rewards) >= 5 else None,
        "sync_bytes": [r.get("weight_sync/bytes") for r in train],
        "median_s": {
            key.split("/")[-1]: _median([r[key] for r in later if key in r])
            for key in ("time/train_s", "time/sync_s", "time/rollout_s", "weight_sync/time_s")
        },
    }


def _write(result: dict) -> None:
    if out := os.environ.get("OUT"):
        Path(out, f"loop_{result['case']}.json").write_text(json.dumps(result, indent=1))


def _run_loop(name: str, backend: str, gpus: int, layout: list[str], workdir: Path) -> dict:
    """Build the model (seed 0) and run train.py with ``layout``; the run's summary, written to ``$OUT`` whatever
    happens. Fails (with the logs' tails) if train.py fails or runs out of time."""
    from vime.tools.make_tiny_model import build_tiny_model

    model_dir = build_tiny_model(workdir / "model", seed=0, **MODEL)
    log_dir = workdir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    timeout = _timeout_s()
    started = time.monotonic()
    with open(log_dir / "train.log", "w") as log:
        proc = subprocess.Popen(
            _argv(backend, model_dir, log_dir, layout),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout)
            error = None if returncode == 0 else f"train.py exited with {returncode}"
        except subprocess.TimeoutExpired:
            _stop(proc)
            error = f"train.py did not finish in {timeout:.0f} s"
    result = _summary(name, backend, gpus, log_dir)
    result |= {"wall_s": time.monotonic() - started, "error": error}
    _write(result)
    print(
        f"\n[{name}] {result['card']} | {len(result['diffs'])} steps in {result['wall_s']:.0f} s | log-prob diff "
        f"mean {result['diff_mean'] or 0:.3e} max {result['diff_max'] or 0:.3e} | reward first5 "
        f"{result['reward_first5'] or 0:.3f} last5 {result['reward_last5'] or 0:.3f} | median step "
        + ", ".join(f"{k} {v:.2f} s" for k, v in result["median_s"].items() if v is not None),
        flush=True,
    )
    if error is not None:
        pytest.fail(f"[{name}] {error}{_log_tails(log_dir)}")
    assert result["steps"] == list(range(NUM_ROLLOUT)), result["steps"]
    assert all(nbytes and nbytes > 0 for nbytes in result["sync_bytes"]), result["sync_bytes"]
    return result


def _check_learns(result: dict) -> None:
    assert result["diff_max"] < 1e-3, result["diffs"]
    assert result["reward_last5"] >= result["reward_first5"] + 0.1, result["rewards"]


def one_gpu_reference(backend: str, workdir: Path) -> dict:
    """The one-GPU run of ``backend`` on this machine (run now unless an earlier test here left it)."""
    saved = REFERENCE_DIR / f"{backend}.json"
    if saved.exists():
        result = json.loads(saved.read_text())
        if result["card"] == torch.cuda.get_device_name(0) and result["error"] is None:
            print(
                f"\n[{backend}-1gpu] reusing {saved}: log-prob diff mean {result['diff_mean']:.3e}",
                flush=True,
            )
            return result
    result = _run_loop(f"{backend}-1gpu", backend, 1, REFERENCE, workdir)
    REFERENCE_DIR.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(result))
    return result


@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_one_gpu_reference(backend, tmp_path):
    _needs(backend)
    _check_learns(one_gpu_reference(backend, tmp_path))


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            name,
            marks=pytest.mark.skipif(torch.cuda.device_count() < gpus, reason=f"needs {gpus} CUDA GPUs"),
        )
        for name, (gpus, _) in CASES.items()
    ],
)
def test_grpo_loop_with_tensor_parallel_engines(case, tmp_path):
    backend = case.split("-")[0].rstrip("0123456789")
    _needs(backend)
    reference = one_gpu_reference(backend, tmp_path / "reference")
    gpus, layout = CASES[case]
    result = _run_loop(case, backend, gpus, layout, tmp_path / "run")
    ratio = result["diff_mean"] / reference["diff_mean"]
    result |= {"reference_diff_mean": reference["diff_mean"], "diff_ratio": ratio}
    _write(result)
    print(f"[{case}] log-prob diff {ratio:.2f}x the one-GPU run's ({reference['diff_mean']:.3e})", flush=True)
    _check_learns(result)
    assert ratio <= DIFF_RATIO, (result["diff_mean"], reference["diff_mean"])
