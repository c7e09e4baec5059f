"""SFT end to end (``--loss-type sft_loss`` with ``vime.rollout.sft_rollout``, no engines): the loss goes down on
chat conversations of the tiny model's task, and an RL run started from the exported SFT model behaves like it
(it answers one digit and stops, where the random-init model runs to the length limit)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def _records(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_sft_lowers_the_loss_and_rl_starts_from_it(tiny_model_dir, tmp_path):
    rows = [json.loads(line) for line in (tiny_model_dir / "train.jsonl").read_text().splitlines()]
    conversations = tmp_path / "sft.jsonl"
    conversations.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["label"]}]}) + "\n"
            for r in rows[:320]
        )
    )  # fmt: skip
    sft = [
        sys.executable, str(REPO / "train.py"), "--train-backend", "fsdp", "--hf-checkpoint", str(tiny_model_dir),
        "--prompt-data", str(conversations), "--input-key", "messages",
        "--rollout-function-path", "vime.rollout.sft_rollout.generate_rollout", "--loss-type", "sft_loss",
        "--debug-train-only", "--calculate-per-token-loss", "--disable-compute-advantages-and-returns",
        "--rollout-batch-size", "32", "--n-samples-per-prompt", "1", "--global-batch-size", "32",
        "--num-epoch", "2", "--lr", "3e-3", "--save-hf", str(tmp_path / "sft_hf"),
        "--log-dir", str(tmp_path / "sft_logs"),
    ]  # fmt: skip
    result = subprocess.run(sft, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "sft loss" in result.stdout
    losses = [r["train/sft_loss"] for r in _records(tmp_path / "sft_logs")]
    assert len(losses) == 20  # 2 epochs x 320 conversations / 32
    # each conversation trains 3 tokens (digit, <|im_end|>, newline); the end of turn is learned first
    assert losses[-1] < 0.35 * losses[0], losses
    assert not (tmp_path / "sft_logs" / "engine_0.log").exists()  # no engine was started

    rl = [
        sys.executable, str(REPO / "train.py"), "--train-backend", "fsdp",
        "--hf-checkpoint", str(tmp_path / "sft_hf"), "--prompt-data", str(tiny_model_dir / "train.jsonl"),
        "--rm-type", "exact", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "3", "--num-rollout", "1", "--lr", "1e-3",
        "--log-dir", str(tmp_path / "rl_logs"), "--vllm-enforce-eager", "--vllm-dtype", "float32",
        "--vllm-max-model-len", "64",
    ]  # fmt: skip
    result = subprocess.run(rl, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    first = _records(tmp_path / "rl_logs")[0]
    # the random-init model runs into the 3-token limit (truncated ratio ~0.94 at these settings); the SFT model
    # answers "<digit><|im_end|>" and stops
    assert first["rollout/truncated_ratio"] < 0.2, first
    assert first["rollout/response_length_mean"] < 2.5, first
