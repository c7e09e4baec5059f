"""``train.py`` end to end on CPU: Ray, a real engine + router, the FSDP2 trainer, weight sync after each step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 5


@pytest.mark.parametrize("transport", ["distributed", "disk"])
def test_engines_track_the_trainer_after_every_weight_sync(transport, tiny_model_dir, tmp_path):
    argv = [
        sys.executable, str(REPO / "train.py"), "--train-backend", "fsdp",
        "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(tiny_model_dir / "train.jsonl"),
        "--rollout-shuffle", "--rm-type", "exact", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "2", "--num-rollout", str(STEPS), "--lr", "5e-3", "--weight-decay", "0",
        "--entropy-coef", "0.1",  # a gradient every step, even when a group's rewards are all equal
        "--update-weight-transport", transport, "--log-dir", str(tmp_path / "logs"),
        "--vllm-enforce-eager", "--vllm-dtype", "float32", "--vllm-max-model-len", "64",
    ]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in records] == list(range(STEPS))
    # Every rollout after the first was generated with weights synced from a trainer that had moved
    # (lr 5e-3): the engine's log-probs must equal the trainer's old log-probs (fp32 both sides).
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in records]
    assert max(diffs) < 1e-3, diffs
    assert [r["weight_sync/version"] for r in records] == [float(v) for v in range(2, STEPS + 2)]
    assert all(r["weight_sync/bytes"] > 0 for r in records)
    assert all(r["train/grad_norm"] > 0 for r in records)  # the policy moved at every step
