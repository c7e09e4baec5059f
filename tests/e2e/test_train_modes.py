"""``train.py`` modes beyond plain GRPO: PPO with a critic (critic-only warm-up steps, ``--critic-save``; on a pooled
engine), and ``--debug-train-only`` (training from saved rollouts without any engine). The two runs are independent
and go side by side (``run_side_by_side``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import new_marker, read_metrics, run_side_by_side, start_run, wait_until_no_marked_processes

from vime.rollout.rollout_manager import save_rollout_data
from vime.utils.types import RolloutFnTrainOutput, Sample, Status

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


class Run:
    """One ``train.py`` run in its own directory (``run_dir``, its logs in ``run_dir``/logs)."""

    def __init__(self, run_dir: Path, name: str, *flags: str):
        self.run_dir = run_dir
        self.marker = new_marker(name)
        self.argv = [
            sys.executable, str(REPO / "train.py"), "--train-backend", "fsdp", "--log-dir", str(run_dir / "logs"),
            *flags,
        ]  # fmt: skip
        run_dir.mkdir(exist_ok=True)

    def start(self):
        return self.run_dir, start_run(self.argv, self.run_dir, self.marker)

    def records(self) -> list[dict]:
        """Its metrics, once it left no process behind."""
        assert wait_until_no_marked_processes(self.marker, timeout=30) == []
        return read_metrics(self.run_dir / "logs")


def test_ppo_with_critic_warm_up_and_train_only_from_saved_rollouts(tiny_model_dir, tmp_path, engine_pool):
    ppo = _ppo_run(tmp_path / "ppo", tiny_model_dir, engine_pool.addrs(1))
    train_only = _train_only_run(tmp_path / "train_only", tiny_model_dir)
    run_side_by_side({"ppo": ppo.start, "train-only": train_only.start}, timeout=540)
    _check_ppo_trains_the_critic_alone_first_then_both(ppo)
    _check_debug_train_only_trains_on_saved_rollouts_without_engines(train_only)


def _ppo_run(run_dir: Path, model_dir: Path, addrs: list[str]) -> Run:
    return Run(
        run_dir, "ppo",
        "--hf-checkpoint", str(model_dir), "--prompt-data", str(model_dir / "train.jsonl"),
        "--advantage-estimator", "ppo", "--kl-coef", "0.01", "--num-critic-only-steps", "1",
        "--rm-type", "exact", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "2", "--num-rollout", "3", "--lr", "1e-3", "--critic-lr", "1e-3",
        "--save", str(run_dir / "ckpt"), "--critic-save", str(run_dir / "critic"), "--save-interval", "3",
        "--save-hf", str(run_dir / "hf" / "step_{rollout_id}"), "--rollout-external-engine-addrs", *addrs,
    )  # fmt: skip


def _check_ppo_trains_the_critic_alone_first_then_both(run: Run) -> None:
    records = run.records()
    assert [r["rollout_id"] for r in records] == [0, 1, 2]
    exported = run.run_dir / "hf" / "step_2"  # --save-hf at the (only) save, loadable by transformers
    assert (exported / "config.json").exists() and list(exported.glob("*.safetensors"))
    assert all(r["critic/value_loss"] > 0 for r in records)
    assert not any(k.startswith("train/") for k in records[0]), "the actor trained during a critic-only step"
    assert all(r["train/grad_norm"] > 0 for r in records[1:])
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-3 for r in records[1:])
    for save_dir in ("ckpt", "critic"):
        assert (run.run_dir / save_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def _train_only_run(run_dir: Path, model_dir: Path) -> Run:
    run_dir.mkdir()
    pattern = str(run_dir / "rollouts" / "rollout_{rollout_id}.json")
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
    return Run(
        run_dir, "train-only",
        "--debug-train-only", "--load-debug-rollout-data", pattern, "--hf-checkpoint", str(model_dir),
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2", "--lr", "1e-3",
    )  # fmt: skip


def _check_debug_train_only_trains_on_saved_rollouts_without_engines(run: Run) -> None:
    records = run.records()
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert all(r["train/grad_norm"] > 0 for r in records)
    assert not any(k.startswith("weight_sync/") for r in records for k in r)
    assert not (run.run_dir / "logs" / "engine_0.log").exists()
