"""``--check-weight-update-equal`` (on by default): after every weight sync each engine proves it holds the trainer's
weights (DESIGN.md §5), in two ways, each naming the engine:

- **Checksums** (:func:`compare_checksums`): each tensor arrives checked against the trainer's checksum of its bytes
  (``weight_buckets.add_checksums``); once loaded, each engine worker records the checksum of every parameter in
  vLLM's own layout (its tensor-parallel shard, fused qkv/gate_up, stacked experts: whatever vLLM's loaders made of
  the trainer's bytes) as that weight version, inside the sync (``weight_sync.record_weights_checksums``). The check
  reads the parameters again afterwards (after the wake-up that follows a sync, or any time) and fails an engine
  whose worker recorded another version (a replacement that never got these weights, a sync that skipped it), whose
  parameter changed since it was loaded (a wake-up that brought other bytes back, memory written behind vLLM's
  back), or whose parameters differ from those of another engine of the same layout given the same weights (one
  engine's load went wrong), naming the first differing tensor. vLLM-layout checksums are taken where vLLM made the
  layout, not predicted on the trainer: that would re-implement every model's loaders (sharding, replicated KV
  heads, padded vocabularies, expert maps, CPU kernels' repacking) and raise false alarms wherever it drifted.
- **A fixed-sequence log-prob probe** (:func:`compare`): each engine scores a fixed sequence as the trainer does
  with the weights it pushed. It covers what checksums cannot: a loader writing the right bytes to the wrong place
  in every engine alike, and on CPU the linear weights vLLM keeps inside its GEMM kernels rather than parameters.
"""

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


def compare_checksums(
    reports: dict[str, list[dict]], version: int, reference: dict | None = None
) -> dict[tuple, tuple[str, list[int]]]:
    """Check the engines' checksum reports (``{url: [one per worker: VimeWorkerExtension.check_weights_checksums's
    answer]}``) for weight version ``version``: ``RuntimeError`` naming every failing engine and its first differing
    tensor. Engines of the same layout (as many workers, each holding parameters of the same names, shapes and dtypes)
    given the same weights must agree bit for bit, worker by worker, with each other and with ``reference`` (what an
    earlier check of this version returned: e.g. the sync's engines, when a replacement is pushed the same version
    alone). Returns the reference of this check: per (workers, worker, layout), the first engine's URL and
    checksums."""
    reference = dict(reference or {})
    problems = []
    for url, workers in reports.items():
        for worker, report in enumerate(workers):
            where = f"engine {url} worker {worker}"
            if "error" in report:
                problems.append(f"{where} could not read its weights: {report['error']}")
            elif report["version"] != version:
                held = (
                    "none since it started" if report["version"] is None else f"version {report['version']}"
                )
                problems.append(
                    f"{where} holds weights recorded by another sync ({held}), not version {version}"
                )
            elif report["changed"] is not None:
                name, recorded, now = report["changed"]
                problems.append(
                    f"{where}: {name} changed since the sync loaded it (checksum {recorded} when loaded, {now} now)"
                )
            else:
                key = (len(workers), worker, report["layout"])
                peer, expected = reference.setdefault(key, (url, report["checksums"]))
                differing = next(
                    (
                        n
                        for n, a, b in zip(report["names"], expected, report["checksums"], strict=True)
                        if a != b
                    ),
                    None,
                )
                if differing is not None:
                    problems.append(f"{where}: {differing} differs from the same tensor of engine {peer}")
    if problems:
        raise RuntimeError(
            f"--check-weight-update-equal: after weight sync {version} engines do not hold the trainer's weights: "
            + "; ".join(problems)
            + ". The run stops rather than generate with other weights (--no-check-weight-update-equal turns the "
            "check off)"
        )
    return reference
