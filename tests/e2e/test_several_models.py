"""``--vllm-config`` end to end on CPU: the policy, a frozen teacher and a frozen reward model (three tiny models),
each behind its own router; on-policy distillation reads the teacher's log-probs from its router, a custom reward
function scores with the judge's, only the policy is synced, and nothing is left running."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import TEST_VLLM_FLAGS, new_marker, read_metrics, run_env, wait_until_no_marked_processes

from vime.tools.make_tiny_model import build_tiny_model
from vime.utils.ppo_utils import log_probs_from_logits

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def transformers_log_probs(model_dir: Path, tokens: list[int], response_length: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, len(tokens) - response_length - 1 : -1]
    return log_probs_from_logits(logits, torch.tensor(tokens[-response_length:]), temperature=1.0)


def test_policy_teacher_and_judge_served_side_by_side(tiny_model_dir, tmp_path):
    teacher, judge = (
        build_tiny_model(tmp_path / name, seed=seed, task=None) for name, seed in (("t", 1), ("j", 2))
    )
    config = tmp_path / "vllm.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            vllm:
              - name: actor
                server_groups: [{{num_gpus: 1}}]
              - name: teacher
                role: teacher
                model_path: {teacher}
                server_groups: [{{num_gpus: 1, overrides: {{max_num_seqs: 64}}}}]
              - name: judge
                role: reward
                model_path: {judge}
                server_groups: [{{num_gpus: 1}}]
            """
        )
    )
    marker = new_marker("vllm-config")
    log_dir = tmp_path / "logs"
    rollouts = tmp_path / "rollouts" / "rollout_{rollout_id}.json"
    argv = [
        sys.executable, str(REPO / "train.py"), "--train-backend", "fsdp", "--hf-checkpoint", str(tiny_model_dir),
        "--prompt-data", str(tiny_model_dir / "train.jsonl"), "--vllm-config", str(config), "--rollout-num-gpus", "3",
        "--use-opd", "--opd-type", "vllm", "--custom-rm-path", "rollout_plugins.judged_with_teacher",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
        "--num-rollout", "2", "--lr", "1e-3", "--save-debug-rollout-data", str(rollouts), "--log-dir", str(log_dir),
        *TEST_VLLM_FLAGS,
    ]  # fmt: skip
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=540, cwd=tmp_path,
        env=run_env(marker, PYTHONPATH=str(Path(__file__).parent)),
    )  # fmt: skip
    logs = "".join(
        f"\n== {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(log_dir.glob("*.log"))
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:] + logs
    assert sorted(p.name for p in log_dir.glob("router*.log")) == [
        "router.log",
        "router_judge.log",
        "router_teacher.log",
    ]
    # the teacher group's override reached its engine only (vLLM logs its non-default arguments)
    assert "'max_num_seqs': 64" in (log_dir / "engine_1_teacher.log").read_text()
    assert "max_num_seqs" not in (log_dir / "engine_0.log").read_text()
    records = [r for r in read_metrics(log_dir) if "rollout/reward_mean" in r]
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert all("train/opd_reverse_kl" in r for r in records)
    assert records[-1]["train/train_rollout_logprob_abs_diff"] < 1e-3  # the policy was synced
    # after a sync the frozen models still serve their own weights: the teacher's and judge's log-probs of the last
    # rollout's samples are the checkpoints' own
    samples = [
        s for g in json.loads(Path(str(rollouts).format(rollout_id=1)).read_text())["samples"] for s in g
    ]
    for s in samples[:3]:
        expected = transformers_log_probs(teacher, s["tokens"], s["response_length"])
        assert torch.allclose(torch.tensor(s["teacher_log_probs"]), expected, atol=1e-4)
        judged = transformers_log_probs(judge, s["tokens"], s["response_length"]).mean().item()
        assert s["reward"] == pytest.approx(judged, abs=1e-4)
    assert wait_until_no_marked_processes(marker, timeout=30) == []
