"""``--use-fault-tolerance`` end to end on CPU with two real vLLM engines behind the router: the API server of one
engine is SIGKILLed (or SIGSTOPped: hung; or the router is SIGKILLed) in the middle of a rollout, or an engine is
SIGKILLed in the middle of a weight sync; the health monitor replaces it, the requests it had in flight are sent
again, training goes on with the other engine while the replacement starts (after a sync it died in: that sync is
done again without it), the replacement rejoins after the first weight sync once it is up, with the current
weights, and the run finishes with every prompt trained exactly once and no process left behind."""

from __future__ import annotations

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
from conftest import (
    marked_processes,
    read_metrics,
    release_sync_when_replacement_is_up,
    run_env,
    wait_until_no_marked_processes,
)

from vime.backends.vllm_utils.weight_sync import HOLD_ENV

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]


def _api_servers(marker: str) -> list[int]:
    return [
        int(line.split(" ", 1)[0])
        for line in marked_processes(marker)
        if "vllm.entrypoints.openai.api_server" in line and "process_guard" not in line
    ]


def _kill_in_sync(marker: str, hold_dir: Path, done: threading.Event, killed: list) -> None:
    """Weight sync 2 (the one after rollout 0) waits once it has paused every engine (``HOLD_ENV``): SIGKILL one
    engine's API server there, and let the sync go on once it is gone."""
    while not done.is_set():
        if (hold_dir / "paused_2").exists():
            server = psutil.Process(_api_servers(marker)[0])
            server.kill()
            killed.append(server.pid)
            server.wait(timeout=30)
            break
        time.sleep(0.05)
    (hold_dir / "hold_2").unlink(missing_ok=True)


PROMPTS, SAMPLES = 8, 8  # per rollout: 64 requests, enough to have some in flight on the engine that dies
SERVERS = {"engine": "vllm.entrypoints.openai.api_server", "router": "vllm::router"}


def _signal_mid_rollout(
    marker: str,
    log_dir: Path,
    done: threading.Event,
    killed: list,
    signals: tuple[tuple[str, signal.Signals], ...],
    num_engines: int,
) -> None:
    """Find the engines' API servers and the router, then signal one of each target (``signals``: target, signal)
    right after rollout 0 is logged (rollout 1 is generating)."""
    pids: dict[str, list[int]] = {}
    for target, _ in signals:
        count, name = num_engines if target == "engine" else 1, SERVERS[target]
        while not done.is_set() and len(pids.get(target, [])) < count:
            pids[target] = [
                int(line.split(" ", 1)[0])
                for line in marked_processes(marker)
                if name in line and "process_guard" not in line
            ]
            time.sleep(0.5)
    metrics = log_dir / "metrics.jsonl"
    while not done.is_set():
        if metrics.exists() and metrics.read_text().strip():
            for target, how in signals:
                os.kill(pids[target][0], how)
                killed.append(pids[target][0])
            return
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("script", "signals", "num_engines"),
    [
        ("train.py", (("engine", signal.SIGKILL),), 2),
        ("train_async.py", (("engine", signal.SIGKILL),), 2),
        ("train.py", (("router", signal.SIGKILL), ("engine", signal.SIGSTOP)), 2),  # both at once
        ("train.py", "in-sync", 2),
        # no engine left to finish the rollout: the replacement gets the weights during it
        ("train.py", (("engine", signal.SIGKILL),), 1),
        ("train_async.py", (("engine", signal.SIGKILL),), 1),  # and the actor is a version ahead
    ],
    ids=[
        "engine-killed",
        "engine-killed-async",
        "router-killed-and-engine-hung",
        "engine-killed-in-sync",
        "only-engine-killed",
        "only-engine-killed-async",
    ],
)
def test_a_dead_or_hung_server_is_replaced_and_no_sample_is_lost(
    tiny_model_dir, tmp_path, script, signals, num_engines
):
    marker = f"ft-{os.getpid()}-{time.time_ns()}"
    log_dir = tmp_path / "logs"
    in_sync = signals == "in-sync"
    # With two engines the survivor serves while the replacement starts. Sync 3 (after rollout 1) is held until the
    # replacement is up and sync 4 admits it: the last rollout runs on both (train_async.py generates it before the
    # sync that ends the step, so one rollout more). With one engine the rollout waits for the replacement.
    num_rollout = 5 if script == "train_async.py" and num_engines == 2 else 4
    argv = [
        sys.executable, str(REPO / script), "--train-backend", "fsdp", "--hf-checkpoint", str(tiny_model_dir),
        "--prompt-data", str(tiny_model_dir / "train.jsonl"), "--rm-type", "exact",
        "--rollout-batch-size", str(PROMPTS), "--n-samples-per-prompt", str(SAMPLES), "--rollout-max-response-len", "96",
        "--rollout-function-path", "bench.fixed_length.generate_rollout",
        "--num-rollout", str(num_rollout), "--lr", "1e-3", "--rollout-num-gpus", str(num_engines),
        "--use-fault-tolerance", "--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "10",
        "--save-debug-rollout-data", str(tmp_path / "rollouts" / "rollout_{rollout_id}.json"),
        "--log-dir", str(log_dir), "--vllm-enforce-eager", "--vllm-dtype", "float32", "--vllm-max-model-len", "160",
    ]  # fmt: skip
    done, killed = threading.Event(), []
    hold_dir = tmp_path / "hold"
    hold_dir.mkdir()
    threads = []
    if in_sync:
        signals = (("engine", signal.SIGKILL),)
        (hold_dir / "hold_2").touch()
        threads.append(threading.Thread(target=_kill_in_sync, args=(marker, hold_dir, done, killed)))
    else:
        threads.append(
            threading.Thread(
                target=_signal_mid_rollout, args=(marker, log_dir, done, killed, signals, num_engines)
            )
        )
    if num_engines == 2:
        (hold_dir / "hold_3").touch()
        threads.append(
            threading.Thread(target=release_sync_when_replacement_is_up, args=(log_dir, hold_dir, 3, done))
        )
    for thread in threads:
        thread.start()
    try:
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=840,
            cwd=tmp_path,
            env=run_env(marker, PYTHONPATH=str(REPO), **{HOLD_ENV: str(hold_dir)}),
        )
    finally:
        done.set()
        for thread in threads:
            thread.join()
    logs = "".join(
        f"\n== {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(log_dir.glob("*.log"))
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:] + logs
    assert len(killed) == len(signals), f"signalled {killed}, expected one process per {signals}"
    records = [r for r in read_metrics(log_dir) if "rollout/reward_mean" in r]
    assert [r["rollout_id"] for r in records] == list(range(num_rollout))
    for target, _ in signals:  # each replaced once, with a log of its own
        assert max(r[f"fault/{target}_restarts"] for r in records) == 1, records
        assert any(p.name.endswith(".restart1.log") for p in log_dir.glob(f"{target}*.log"))
    if in_sync:  # the sync the engine died in (logged with rollout 0) was done again, once
        assert [r["fault/sync_retries"] for r in records] == [1.0] + [0.0] * (num_rollout - 1), records
    if num_engines == 2 and signals == (("engine", signal.SIGKILL),):
        # the sync after the death (in-sync: its retry, logged with rollout 0; else the one after the rollout it
        # died in, logged with rollout 1) went on with the survivor instead of waiting for the replacement's start
        after_death = records[0 if in_sync else 1]
        assert after_death["weight_sync/engines"] == 1, records
    assert records[-1]["weight_sync/engines"] == num_engines, records  # the replacement rejoined

    # requests in flight on the killed engine were sent again: by vllm-router itself (it retries a request whose
    # worker connection broke) or by the rollout (fault/requeued_samples); either way none is lost or doubled
    assert all("fault/requeued_samples" in r for r in records)
    # every rollout is whole: PROMPTS groups of SAMPLES, all generated; no prompt twice in the epoch
    prompts = []
    for rollout_id in range(num_rollout):
        data = json.loads((tmp_path / "rollouts" / f"rollout_{rollout_id}.json").read_text())
        groups = data["samples"]
        assert len(groups) == PROMPTS and all(len(g) == SAMPLES for g in groups)
        assert all(s["status"] in ("completed", "truncated") for g in groups for s in g), rollout_id
        prompts += [g[0]["metadata"]["prompt_index"] for g in groups]
    assert len(prompts) == len(set(prompts)) == PROMPTS * num_rollout

    # the engines of one machine compute on their own cores (vLLM logs the cores its worker binds to); a
    # replacement keeps its slot's
    cores = {
        p.name: re.findall(r"core ids=(\[[\d, ]*\])", p.read_text(errors="replace"))
        for p in log_dir.glob("engine_*.log")
    }
    if num_engines == 2 and len(os.sched_getaffinity(0)) >= 2:
        assert cores["engine_0.log"][:1] != cores["engine_1.log"][:1] and all(cores.values()), cores
    for name, found in cores.items():
        assert found[:1] == cores[name.split(".")[0] + ".log"][:1], cores

    # a replaced engine served the last rollouts with the trained weights: log-probs agree with the trainer's
    if any(target == "engine" for target, _ in signals):
        replacement = next(log_dir.glob("engine_*.restart1.log")).read_text(errors="replace")
        assert "POST /v1/completions" in replacement
    assert records[-1]["train/train_rollout_logprob_abs_diff"] < 1e-3, records[-1]
    assert wait_until_no_marked_processes(marker, timeout=30) == []
    assert not [
        p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])
    ]
