"""``train.py`` joins an existing Ray cluster (``ray start --head`` + ``RAY_ADDRESS``, with the token authentication
Ray 2.60 turns on, so the driver runs with ``RAY_AUTH_MODE=token`` as the README says) instead of starting its own,
and leaves the cluster running but free of its processes."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import RUN_MARKER_ENV, TEST_VLLM_FLAGS, marked_processes, new_marker, read_metrics, run_env

from vime.utils.misc import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def _kill_marked(marker: str) -> None:
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(RUN_MARKER_ENV) == marker:
                proc.kill()
        except psutil.Error:
            pass


def _run_processes(marker: str) -> list[str]:
    """The run's own processes (engines, router, actors) among those of the test's cluster."""
    keys = ("vllm", "VLLM", "TrainRayActor", "RolloutManager")
    return [p for p in marked_processes(marker) if any(key in p for key in keys)]


def test_train_on_an_existing_ray_cluster(tiny_model_dir, tmp_path):
    marker = new_marker("cluster")
    port = free_port()
    temp_dir = Path(f"/tmp/vime-ray-{port}")  # short: Ray's socket paths must stay under ~107 characters
    env = run_env(marker)
    env.pop("RAY_ADDRESS", None)
    ray_cli = Path(sys.executable).with_name("ray")
    head = [
        str(ray_cli), "start", "--head", "--port", str(port), "--num-cpus", "4", "--temp-dir", str(temp_dir),
        "--include-dashboard", "false", "--disable-usage-stats",
    ]  # fmt: skip
    try:
        started = subprocess.run(head, env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        argv = [
            sys.executable, str(REPO / "train.py"), "--train-backend", "fsdp",
            "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(tiny_model_dir / "train.jsonl"),
            "--rm-type", "exact", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "1", "--num-rollout", "2", "--log-dir", str(tmp_path / "logs"),
            *TEST_VLLM_FLAGS,
        ]  # fmt: skip
        result = subprocess.run(
            argv,
            env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_AUTH_MODE": "token"},
            capture_output=True,
            text=True,
            timeout=500,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert (
            "Connected to Ray cluster" in result.stderr
            and "Started a local Ray instance" not in result.stderr
        )
        assert list(temp_dir.glob("session_*/logs/worker-*")), "the run's actors did not run on the cluster"
        assert [r["rollout_id"] for r in read_metrics(tmp_path / "logs")] == [0, 1]
        # The cluster stays up; the run's engines, router and actors are gone.
        deadline = time.monotonic() + 30
        while (left := _run_processes(marker)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == []
        assert any("gcs_server" in p for p in marked_processes(marker)), "the test's cluster should still run"
    finally:
        _kill_marked(marker)
        shutil.rmtree(temp_dir, ignore_errors=True)
