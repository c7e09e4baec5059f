"""SFT end to end (``--loss-type sft_loss`` with ``vime.rollout.sft_rollout``, no engines): the loss goes down on
chat conversations of the tiny model's task, and an RL run started from the exported SFT model behaves like it
(it answers one digit and stops, where the random-init model runs to the length limit). The RL run's engine starts
while SFT trains (it takes ~40 s on 2 cores, the SFT run mostly waits on its own start-up): it holds the random-init
weights, served under the export's name, until the RL run pushes its own (the SFT model's) before rollout 0, so what
it generates is the SFT model's only if the trainer loaded the export and synced it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import new_marker, start_run

from vime.backends.vllm_utils.external_engines import WORKER_EXTENSION_CLS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def _records(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_sft_lowers_the_loss_and_rl_starts_from_it(tiny_model_dir, tmp_path, engine_factory):
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
    (tmp_path / "sft_run").mkdir()
    sft_run = start_run(sft, tmp_path / "sft_run", new_marker("sft"))
    try:
        served_as = ("--served-model-name", str(tmp_path / "sft_hf"))  # the name the RL run's requests give
        engine = engine_factory(
            tiny_model_dir, extra_args=("--worker-extension-cls", WORKER_EXTENSION_CLS, *served_as)
        )
        returncode = sft_run.wait(timeout=300)
    finally:
        sft_run.kill()  # a no-op once it ended
    stdout, stderr = ((tmp_path / "sft_run" / name).read_text() for name in ("stdout.txt", "stderr.txt"))
    assert returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "sft loss" in stdout
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
        "--log-dir", str(tmp_path / "rl_logs"), "--rollout-external-engine-addrs", engine.url.removeprefix("http://"),
    ]  # fmt: skip
    result = subprocess.run(rl, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    first = _records(tmp_path / "rl_logs")[0]
    # the random-init model runs into the 3-token limit (truncated ratio ~0.94 at these settings); the SFT model
    # answers "<digit><|im_end|>" and stops
    assert first["rollout/truncated_ratio"] < 0.2, first
    assert first["rollout/response_length_mean"] < 2.5, first
