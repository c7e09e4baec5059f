"""SIGKILL ``train.py`` after a checkpoint: every process of the run goes with it (its own local Ray instance too),
and ``--load`` resumes at the next rollout id with the same data order and no prompt duplicated or skipped. While it
runs, none of its processes (Ray's, the driver, the trainer's stores, router, engine) listens beyond loopback. The
killed run starts its own engine, which must go with it; the resumed run attaches to a pooled one."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    TEST_VLLM_FLAGS,
    new_marker,
    non_loopback_listeners,
    read_metrics,
    run_env,
    wait_until_no_marked_processes,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
NUM_PROMPTS, BATCH, NUM_ROLLOUT, SAVE_INTERVAL = (
    12,
    4,
    8,
    3,
)  # 3 rollouts per epoch; saves after rollouts 2, 5, 7


def _argv(model_dir: Path, tmp_path: Path, name: str, engines: list[str]) -> list[str]:
    """The run's command, attached to ``engines``, or with no ``engines`` starting one of its own."""
    own = ["--rollout-num-gpus", "1", *TEST_VLLM_FLAGS]
    return [
        sys.executable, str(REPO / "train.py"), "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir),
        "--prompt-data", f"{model_dir}/train.jsonl@[0:{NUM_PROMPTS}]", "--rollout-shuffle", "--rm-type", "exact",
        "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", "2", "--rollout-max-response-len", "1",
        "--num-rollout", str(NUM_ROLLOUT), "--lr", "1e-3", "--save-interval", str(SAVE_INTERVAL),
        "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / name),
        "--save-debug-rollout-data", str(tmp_path / name / "rollout_{rollout_id}.json"),
        "--rollout-function-path", "rollout_plugins.stall_at_rollout",
        *(["--rollout-external-engine-addrs", *engines] if engines else own),
    ]  # fmt: skip


def _env(marker: str, **extra: str) -> dict[str, str]:
    # PYTHONPATH reaches the Ray workers, so the rollout manager imports rollout_plugins.
    return run_env(marker, PYTHONPATH=str(Path(__file__).parent), **extra)


def _logged_rollout_3(log_dir: Path) -> bool:
    try:
        return any(r.get("rollout_id") == 3 for r in read_metrics(log_dir))
    except (FileNotFoundError, ValueError):  # not written yet, or a line being written
        return False


def _prompt_indices(run_dir: Path) -> dict[int, list[int]]:
    """rollout id -> the prompt index of each group, from the rollouts the run dumped."""
    result = {}
    for path in run_dir.glob("rollout_*.json"):
        data = json.loads(path.read_text())
        result[data["rollout_id"]] = [group[0]["metadata"]["prompt_index"] for group in data["samples"]]
    return result


def test_sigkill_after_save_then_load_resumes_with_the_same_prompts(tiny_model_dir, tmp_path, engine_pool):
    killed_marker, resumed_marker = new_marker("killed"), new_marker("resumed")
    with open(tmp_path / "killed.log", "w") as log:
        killed = subprocess.Popen(
            _argv(tiny_model_dir, tmp_path, "killed", []), stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
            env=_env(killed_marker, VIME_TEST_STALL_AT="4"),
        )  # fmt: skip
        # The run checkpoints rollout 2, completes rollout 3, then stalls generating rollout 4: kill it there.
        deadline = time.monotonic() + 600
        while not _logged_rollout_3(tmp_path / "killed") and killed.poll() is None:
            assert time.monotonic() < deadline, "rollout 3 never came"
            time.sleep(0.2)
        exposed = non_loopback_listeners(killed_marker)
        killed.kill()
        killed.wait()
    assert killed.returncode == -9, (tmp_path / "killed.log").read_text()[-3000:]
    assert exposed == [], "a local run listens beyond loopback"
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # Ray's own agents would outlive a SIGKILLed driver by a minute without vime.utils.reaper
    assert wait_until_no_marked_processes(killed_marker, timeout=30) == [], "the killed run left processes"

    resumed = subprocess.run(
        _argv(tiny_model_dir, tmp_path, "resumed", engine_pool.addrs(1)), capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env=_env(resumed_marker),
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [
        r["rollout_id"] for r in read_metrics(tmp_path / "resumed") if "rollout/reward_mean" in r
    ] == list(range(3, NUM_ROLLOUT))
    before, after = _prompt_indices(tmp_path / "killed"), _prompt_indices(tmp_path / "resumed")
    assert sorted(after) == list(range(3, NUM_ROLLOUT))
    # The same prompts as the run that was killed (a rollout lists its groups in completion order).
    assert sorted(after[3]) == sorted(before[3])
    served = [
        i for rollout_id in range(NUM_ROLLOUT) for i in (before if rollout_id < 3 else after)[rollout_id]
    ]
    epochs = [served[i : i + NUM_PROMPTS] for i in range(0, len(served), NUM_PROMPTS)]
    for epoch in epochs[:-1]:  # each full epoch serves every prompt exactly once
        assert sorted(epoch) == list(range(NUM_PROMPTS)), served
    assert len(set(epochs[-1])) == len(epochs[-1]), served  # no repeat within the last, partial epoch
    assert epochs[0] != epochs[1], "shuffled epochs should differ"
    assert wait_until_no_marked_processes(resumed_marker, timeout=30) == []
