"""CPU quick start: GRPO on a tiny random-init Qwen3 learns the "n+3=" -> (n+3) mod 10 task.

Builds the model, tokenizer and task offline, then runs ``train.py`` (Ray, a real vLLM engine behind
vllm-router, the FSDP2 trainer, weight sync after every step) and plots reward and train/rollout log-prob
difference. Takes a few minutes on 2 cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_DIR = Path(os.environ.get("VIME_QUICKSTART_DIR", "runs/quickstart")).resolve()


def quickstart_argv(model_dir: Path, run_dir: Path, num_rollout: int = 100) -> list[str]:
    """GRPO, 32 prompts x 16 samples, one response token; checkpoints and logs under ``run_dir``. The 20-step
    learning-rate warm-up keeps early updates from collapsing a few prompts on a wrong answer (all 16 samples wrong
    gives GRPO no signal there, and the reward then plateaus near 0.7)."""
    return [
        "--train-backend", "fsdp",
        "--hf-checkpoint", str(model_dir),
        "--prompt-data", str(model_dir / "train.jsonl"), "--rollout-shuffle",
        "--eval-prompt-data", "add3", str(model_dir / "eval.jsonl"), "--eval-interval", "25",
        "--rm-type", "exact", "--advantage-estimator", "grpo",
        "--rollout-batch-size", "32", "--n-samples-per-prompt", "16",
        "--rollout-max-response-len", "1", "--rollout-temperature", "1.0",
        "--num-rollout", str(num_rollout), "--lr", "1e-3", "--lr-warmup-iters", "20", "--weight-decay", "0",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096",
        "--save", str(run_dir / "ckpt"), "--save-interval", str(num_rollout), "--log-dir", str(run_dir / "logs"),
        "--vllm-enforce-eager", "--vllm-dtype", "float32", "--vllm-max-model-len", "64",
    ]  # fmt: skip


def main() -> int:
    from vime.tools.make_tiny_model import build_tiny_model
    from vime.utils.plot import plot_run

    model_dir = build_tiny_model(RUN_DIR / "model", seed=0)
    print(f"[quickstart] tiny model, tokenizer and task written to {model_dir}", flush=True)
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *quickstart_argv(model_dir, RUN_DIR)], cwd=REPO
    )
    if result.returncode:
        return result.returncode
    png = plot_run(RUN_DIR / "logs")
    print(f"[quickstart] reward and log-prob-diff curves: {png}")
    print(f"[quickstart] metrics: {RUN_DIR / 'logs' / 'metrics.jsonl'} | checkpoints: {RUN_DIR / 'ckpt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
