"""``--check-weight-update-equal``: after a weight sync, the engines must score a fixed sequence as the trainer does
(DESIGN.md §5's correctness check, run by the loop instead of only by tests)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CHECK_LENGTH = 24


def check_tokens(hf_checkpoint: str) -> list[int]:
    """A fixed sequence of ``CHECK_LENGTH`` token ids spread over the model's vocabulary."""
    config = json.loads((Path(hf_checkpoint) / "config.json").read_text(encoding="utf-8"))
    vocab = config.get("text_config", config)["vocab_size"]
    return [(7919 * i + 11) % vocab for i in range(CHECK_LENGTH)]


def tolerance(args: argparse.Namespace, engine_dtype: str | None = None) -> float:
    """Largest mean |log-prob difference| accepted: fp32 on both sides agrees to ~3e-7 (1e-5 leaves room for
    kernels, not for weights one optimizer step apart, ~1e-4), half precision to ~1e-2; an engine left with other
    weights is off by far more. ``engine_dtype`` is what the engines serve (external engines report it), else
    ``--vllm-dtype``."""
    dtype = str(engine_dtype or getattr(args, "vllm_dtype", "auto")).removeprefix("torch.")
    fp32_engine = dtype in ("float32", "float")
    return 1e-5 if fp32_engine and not (args.bf16 or args.fp16) else 5e-2


def compare(trainer: list[float], engines: dict[str, list[float]], tol: float, version: int) -> float:
    """The largest mean |difference| over the engines; ``RuntimeError`` naming each engine above ``tol``."""
    import torch  # here: the driver imports this module, and needs torch only when the check is on

    expected = torch.tensor(trainer, dtype=torch.float64)
    diffs = {
        url: float((torch.tensor(got, dtype=torch.float64) - expected).abs().mean())
        for url, got in engines.items()
    }
    bad = {url: diff for url, diff in diffs.items() if diff > tol}
    if bad:
        listed = ", ".join(f"{url}: {diff:.3g}" for url, diff in bad.items())
        raise RuntimeError(
            f"--check-weight-update-equal: after weight sync {version} the engines' log-probs of a fixed sequence "
            f"differ from the trainer's by more than {tol:g} on average ({listed}); the sync left weights behind"
        )
    return max(diffs.values(), default=0.0)
