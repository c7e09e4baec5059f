"""A train.py / train_async.py driver orchestrates Ray actors and never computes: it imports neither torch,
transformers nor vLLM (together ~8 CPU-s per run, and the e2e suite starts ~25 drivers). The actors import what
they use, where they run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vime.utils.arguments import build_parser

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "vllm")
DRIVER = f"""
import sys
import train, train_async  # the entry points and everything they import
from vime.utils.arguments import parse_args
parse_args(sys.argv[1:])
print(sorted(name for name in {HEAVY!r} if name in sys.modules))
"""
ARGV = (
    "--train-backend fsdp --hf-checkpoint /m --prompt-data /d.jsonl --rollout-batch-size 4 --n-samples-per-prompt 4 "
    "--num-rollout 3 --rollout-external-engine-addrs 127.0.0.1:8000"
).split()


def test_a_driver_imports_no_torch_transformers_or_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    build_parser().mirror_vllm_flags()  # fills the --vllm-* defaults cache a driver without such flags reads
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, *ARGV], capture_output=True, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == "[]", result.stdout
