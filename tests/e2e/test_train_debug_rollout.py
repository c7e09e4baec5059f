"""``train.py --debug-rollout-only`` end to end: engines, router, rollouts, eval, buffer save, clean exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import new_marker, run_env, wait_until_no_marked_processes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def test_debug_rollout_only_runs_rollouts_eval_and_save_then_leaves_no_process(tiny_model_dir, tmp_path):
    save = tmp_path / "ckpt"
    argv = [
        sys.executable, str(REPO / "train.py"), "--debug-rollout-only", "--train-backend", "fsdp",
        "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(tiny_model_dir / "train.jsonl"),
        "--rm-type", "exact", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "3", "--num-rollout", "2",
        "--eval-prompt-data", "add3", str(tiny_model_dir / "eval.jsonl"), "--eval-interval", "1",
        "--save", str(save), "--save-interval", "1", "--log-dir", str(tmp_path / "logs"),
        "--vllm-enforce-eager", "--vllm-dtype", "float32", "--vllm-max-model-len", "128",
    ]  # fmt: skip
    marker = new_marker("debug-rollout")
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=540, cwd=tmp_path, env=run_env(marker)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for line in (
        "[eval rollout 0] add3 reward",
        "[rollout 0/2] reward",
        "[eval rollout 1]",
        "[rollout 1/2] reward",
    ):
        assert line in result.stdout, result.stdout
    state = json.loads((save / "iter_0000001" / "data_source.json").read_text())
    assert state["next_group_index"] == 8  # 2 rollouts x 4 prompts
    assert (tmp_path / "logs" / "engine_0.log").exists() and (tmp_path / "logs" / "router.log").exists()
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in records if "rollout/reward_mean" in r] == [0, 1]
    # nothing of the run is left: no process of its own, its router included (the marker is in every environment the
    # run hands down; vllm-router renames its process, and the pooled engines serve the same model, so neither name nor
    # the model's path would tell), none that names its directories
    assert wait_until_no_marked_processes(marker, timeout=30) == []
    leftovers = [
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline"])
        if any(str(tmp_path) in part for part in (p.info["cmdline"] or []))
    ]
    assert not leftovers, leftovers
