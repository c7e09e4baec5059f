"""``--use-fault-tolerance`` on GPUs (issue 16): while rollout 1 generates, the engine's vLLM API server is
SIGKILLed (``server-killed``), or it hangs (SIGSTOP) and the Ray actor that owns it is SIGKILLed
(``actor-killed-server-hung``: Ray then SIGKILLs the actor's process guard, and the rollout manager ends the hung
server and its engine core from a task on their node). Either way the replacement starts on the same GPU and asks
for most of its memory, so it starts only if the dead engine's memory was given back. The run must finish every rollout with each prompt
trained once, the replacement's log-probs equal to the trainer's, and no process left.

Split layout (trainer on GPU 0, engine on GPU 1, NCCL sync), so 2 GPUs (``nvidia-h200-x2``): vime refuses
``--use-fault-tolerance`` with sleeping (colocated) engines. Needs the GPU kit (tests/gpu/README.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from vime.utils.process_group import group_members

REPO = Path(__file__).resolve().parents[2]
NUM_ROLLOUT = 4
PROMPTS, SAMPLES = 16, 8
ENGINE_LINE = re.compile(r"\[vime\] engine 0 \(policy\): .* server pid (\d+) \(owned by actor pid (\d+)\)")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in ("vllm", "ray", "vllm_router")),
        reason="needs vllm, ray and vllm-router (the GPU kit)",
    ),
]


def _fail_engine(
    how: str, guard_pid: int, actor_pid: int, metrics: Path, done: threading.Event, log: list
) -> None:
    """Once rollout 0 is logged (rollout 1 is starting), fail the engine as ``how`` says."""
    while not done.is_set() and not (metrics.is_file() and metrics.read_text().strip()):
        time.sleep(0.05)
    if done.is_set():
        return
    server = [p for p in group_members(guard_pid) if p.pid != guard_pid]  # API server, engine core, workers
    if how == "server-killed":
        next(p for p in server if "api_server" in " ".join(p.cmdline())).kill()
    else:
        for proc in server:
            proc.suspend()
        os.kill(actor_pid, signal.SIGKILL)
    log.append(how)


@pytest.mark.parametrize("how", ["server-killed", "actor-killed-server-hung"])
def test_a_failed_gpu_engine_is_replaced_on_its_gpu_and_no_sample_is_lost(how, tmp_path):
    from vime.tools.make_tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", seed=0, max_position_embeddings=2176)
    log_dir = tmp_path / "logs"
    argv = [
        sys.executable, str(REPO / "train.py"), "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir),
        "--prompt-data", str(model_dir / "train.jsonl"), "--rm-type", "exact",
        "--rollout-batch-size", str(PROMPTS), "--n-samples-per-prompt", str(SAMPLES),
        "--rollout-max-response-len", "2048", "--rollout-function-path", "bench.fixed_length.generate_rollout",
        "--num-rollout", str(NUM_ROLLOUT), "--lr", "1e-3",
        "--use-fault-tolerance", "--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "5",
        "--save-debug-rollout-data", str(tmp_path / "rollouts" / "rollout_{rollout_id}.json"),
        "--log-dir", str(log_dir), "--vllm-enforce-eager", "--vllm-dtype", "float32",
        "--vllm-max-model-len", "2176", "--vllm-gpu-memory-utilization", "0.8",
        "--update-weight-transport", "distributed",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.Popen(
        argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines, done, failed = [], threading.Event(), []
    killer = None
    timer = threading.Timer(540, run.kill)  # a hung run fails here, not at the device's time limit
    timer.start()
    try:
        for line in run.stdout:
            lines.append(line)
            if killer is None and (match := ENGINE_LINE.search(line)):
                server_pid, actor_pid = (int(pid) for pid in match.groups())
                killer = threading.Thread(
                    target=_fail_engine,
                    args=(how, server_pid, actor_pid, log_dir / "metrics.jsonl", done, failed),
                )
                killer.start()
        returncode = run.wait()
    finally:
        timer.cancel()
        done.set()
        if killer is not None:
            killer.join()
    logs = "".join(
        f"\n== {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(log_dir.glob("*.log"))
    )
    assert returncode == 0, "".join(lines[-60:]) + logs
    assert failed == [how], "the engine was not failed mid-run"

    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "rollout/reward_mean" in r]
    assert [r["rollout_id"] for r in records] == list(range(NUM_ROLLOUT))
    assert max(r["fault/engine_restarts"] for r in records) == 1, records
    replacement = (log_dir / "engine_0.restart1.log").read_text(errors="replace")
    assert "POST /v1/completions" in replacement, replacement[-3000:]
    prompts = []
    for rollout_id in range(NUM_ROLLOUT):
        groups = json.loads((tmp_path / "rollouts" / f"rollout_{rollout_id}.json").read_text())["samples"]
        assert len(groups) == PROMPTS and all(len(g) == SAMPLES for g in groups), rollout_id
        assert all(s["status"] in ("completed", "truncated") for g in groups for s in g), rollout_id
        assert all(s["response_length"] == 2048 for g in groups for s in g), rollout_id
        prompts += [g[0]["metadata"]["prompt_index"] for g in groups]
    assert len(prompts) == len(set(prompts)) == PROMPTS * NUM_ROLLOUT
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in records]
    assert max(diffs[1:]) < 1e-3, diffs  # rollouts 1..3 include the replacement's samples
    print(
        f"\n[ft split {how}] rollout times {[round(r['time/rollout_s'], 1) for r in records]} s; requeued "
        f"{[r['fault/requeued_samples'] for r in records]}; logprob diff max {max(diffs):.1e}"
    )

    deadline = time.monotonic() + 60
    while (left := _run_processes(tmp_path)) and time.monotonic() < deadline:
        time.sleep(1)
    assert left == [], left


def _run_processes(tmp_path: Path) -> list[str]:
    """Live processes whose command line names this test's directory (engines, guards, the driver)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            command = " ".join(proc.info["cmdline"] or [])
            if str(tmp_path) in command and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(f"{proc.pid} {command[:160]}")
        except psutil.Error:
            pass
    return found
