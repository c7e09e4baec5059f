"""The fully-async rollout end to end on CPU: ``train_async.py`` on the quick-start task with the pooled vLLM
engines (``--rollout-external-engine-addrs``), vllm-router, Ray and the FSDP trainer. The reward rises; no trained sample lags the weights that train on it by
more than ``--max-staleness`` (read from every sample's ``weight_versions`` in ``--save-debug-rollout-data``, against
the trainer's version counted independently: train_async.py trains rollout r on weight version r + 1); the worker
does run ahead (lag 2 occurs); the final checkpoint's data buffer holds exactly the drawn, untrained groups; nothing
is left running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_metrics, run_env, wait_until_no_marked_processes, without_vllm_flags
from test_loop_learns import _quickstart_argv

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
NUM_ROLLOUT = 55  # the 5-step mean passes 0.5 at ~35-45 (samples two weight versions old)
MAX_STALENESS = 2


def test_train_async_with_fully_async_rollout_learns_within_the_staleness_bound(
    tiny_model_dir, tmp_path, engine_pool
):
    marker = f"fully-async-{tmp_path.name}"
    argv = [
        sys.executable, str(REPO / "train_async.py"),
        *without_vllm_flags(_quickstart_argv(tiny_model_dir, tmp_path, NUM_ROLLOUT)),
        "--rollout-external-engine-addrs", *engine_pool.addrs(),
        "--rollout-function-path", "vime.rollout.fully_async_rollout.generate_rollout",
        "--max-staleness", str(MAX_STALENESS),
        "--save-debug-rollout-data", str(tmp_path / "rollouts" / "{rollout_id}.json"),
    ]  # fmt: skip
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=840, cwd=tmp_path, env=run_env(marker)
    )
    assert result.returncode == 0, result.stderr[-3000:]

    records = [r for r in read_metrics(tmp_path / "logs") if "rollout/reward_mean" in r]
    assert [r["rollout_id"] for r in records] == list(range(NUM_ROLLOUT))
    rewards = [r["rollout/reward_mean"] for r in records]
    moving = [sum(rewards[i : i + 5]) / 5 for i in range(len(rewards) - 4)]
    assert moving[0] < 0.3 and max(moving) > 0.5, rewards

    trained_groups, all_lags = [], []
    for record in records:
        rollout_id = record["rollout_id"]
        data = json.loads((tmp_path / "rollouts" / f"{rollout_id}.json").read_text())
        lags = [rollout_id + 1 - min(s["weight_versions"]) for group in data["samples"] for s in group]
        assert len(lags) == 32 * 16 and 0 <= min(lags) and max(lags) <= MAX_STALENESS, (
            rollout_id,
            sorted(set(lags)),
        )
        assert record["fully_async/staleness_max"] == max(lags)
        all_lags += lags
        trained_groups += [group[0]["group_index"] for group in data["samples"]]
    assert MAX_STALENESS in all_lags  # the worker generated ahead, across a weight sync

    # the checkpoint of the last rollout: the groups in flight at the end, as prompts, and nothing trained
    state = json.loads((tmp_path / "ckpt" / f"iter_{NUM_ROLLOUT - 1:07d}" / "data_source.json").read_text())
    held = [group[0]["group_index"] for group in state["buffer"]]
    assert held and sorted(trained_groups + held) == list(range(state["next_group_index"]))
    assert all(
        s["response_length"] == 0 and not s["weight_versions"] for group in state["buffer"] for s in group
    )

    assert any("eval/add3/mean_reward" in r for r in read_metrics(tmp_path / "logs")), "no eval record"
    assert wait_until_no_marked_processes(marker, timeout=30) == []
