"""``train.py`` modes beyond plain GRPO: PPO with a critic (critic-only warm-up steps, ``--critic-save``; on a pooled
engine), and ``--debug-train-only`` (training from saved rollouts without any engine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_metrics, run_env, wait_until_no_marked_processes

from vime.rollout.rollout_manager import save_rollout_data
from vime.utils.types import RolloutFnTrainOutput, Sample, Status

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def _train(tmp_path: Path, marker: str, *flags: str) -> list[dict]:
    argv = [
        sys.executable,
        str(REPO / "train.py"),
        "--train-backend",
        "fsdp",
        "--log-dir",
        str(tmp_path / "logs"),
        *flags,
    ]
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=540, cwd=tmp_path, env=run_env(marker)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert wait_until_no_marked_processes(marker, timeout=30) == []
    return read_metrics(tmp_path / "logs")


def test_ppo_trains_the_critic_alone_first_then_both(tiny_model_dir, tmp_path, engine_pool):
    records = _train(
        tmp_path, f"ppo-{tmp_path.name}",
        "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(tiny_model_dir / "train.jsonl"),
        "--advantage-estimator", "ppo", "--kl-coef", "0.01", "--num-critic-only-steps", "1",
        "--rm-type", "exact", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "2", "--num-rollout", "3", "--lr", "1e-3", "--critic-lr", "1e-3",
        "--save", str(tmp_path / "ckpt"), "--critic-save", str(tmp_path / "critic"), "--save-interval", "3",
        "--save-hf", str(tmp_path / "hf" / "step_{rollout_id}"), "--rollout-external-engine-addrs", *engine_pool.addrs(1),
    )  # fmt: skip
    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    exported = tmp_path / "hf" / "step_2"  # --save-hf at the (only) save, loadable by transformers
    assert (exported / "config.json").exists() and list(exported.glob("*.safetensors"))
    assert all(r["critic/value_loss"] > 0 for r in records)
    assert not any(k.startswith("train/") for k in records[0]), "the actor trained during a critic-only step"
    assert all(r["train/grad_norm"] > 0 for r in records[1:])
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-3 for r in records[1:])
    for save_dir in ("ckpt", "critic"):
        assert (tmp_path / save_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_debug_train_only_trains_on_saved_rollouts_without_engines(tiny_model_dir, tmp_path):
    pattern = str(tmp_path / "rollouts" / "rollout_{rollout_id}.json")
    for rollout_id in range(2):  # 2 prompts x 2 samples, rewarded 1 and 0 so GRPO has a signal
        groups = [
            [
                Sample(group_index=g, index=2 * g + i, tokens=[5 + g, 6, 7 + i], response_length=1,
                       reward=float(i), status=Status.COMPLETED)
                for i in range(2)
            ]
            for g in range(2)
        ]  # fmt: skip
        save_rollout_data(
            pattern.format(rollout_id=rollout_id), rollout_id, RolloutFnTrainOutput(samples=groups)
        )
    records = _train(
        tmp_path, f"train-only-{tmp_path.name}",
        "--debug-train-only", "--load-debug-rollout-data", pattern, "--hf-checkpoint", str(tiny_model_dir),
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2", "--lr", "1e-3",
    )  # fmt: skip
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert all(r["train/grad_norm"] > 0 for r in records)
    assert not any(k.startswith("weight_sync/") for r in records for k in r)
    assert not (tmp_path / "logs" / "engine_0.log").exists()
