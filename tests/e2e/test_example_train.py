"""One example through a whole training step: ``examples/gsm8k/run-tiny-cpu.sh`` (train.py with Ray, a real engine +
router, the FSDP trainer, weight sync, eval) on GSM8K prompts with the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_env, wait_until_no_marked_processes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("VIME_SHARED_DIR", REPO.parent / "shared"))


def test_gsm8k_tiny_recipe_trains_a_step_and_evaluates(tiny_model_dir, tmp_path):
    if not (SHARED / "data" / "gsm8k_test.jsonl").exists():
        pytest.skip(f"GSM8K test split not found under {SHARED}/data (set VIME_SHARED_DIR)")
    marker = f"gsm8k-example-{os.getpid()}"
    env = run_env(
        marker, PYTHON=sys.executable, TINY_MODEL=str(tiny_model_dir), RUN_DIR=str(tmp_path),
        VIME_SHARED_DIR=str(SHARED),
    )  # fmt: skip
    script = REPO / "examples" / "gsm8k" / "run-tiny-cpu.sh"
    result = subprocess.run(
        ["bash", str(script), "--num-rollout", "1"], env=env, capture_output=True, text=True, timeout=840
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not wait_until_no_marked_processes(marker)
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    merged = {k: v for r in records for k, v in r.items()}
    assert (
        merged["eval/gsm8k/num_samples"] > 0 and merged["eval/gsm8k/failed"] == 0
    )  # prompts fit the context
    assert merged["rollout/submitted_groups"] == 4 and merged["rollout/failed_samples"] == 0
    assert merged["rollout/reward_mean"] in (
        0.0,
        0.0625,
        0.125,
    )  # the random model rarely hits a GSM8K answer
    assert merged["train/train_rollout_logprob_abs_diff"] < 1e-3 and merged["weight_sync/version"] == 2.0
