"""Model shapes the GPU benchmarks use (random-init Qwen3 checkpoints built on the machine with Qwen3's 151,936-token
vocabulary), and the helpers every benchmark shares: build (or reuse) a checkpoint, count its parameters, write a
JSON result."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import re
import time
from pathlib import Path
from typing import Any

# make_tiny_model flags of each shape (Qwen3 dense layouts); the vocabulary is set apart (build_shape's vocab_size).
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {},
    "0.6b": dict(num_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072),
    "4b": dict(num_layers=36, hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=9728),
}  # fmt: skip
# Qwen3-30B-A3B's layer (slime's scripts/models/qwen3-30B-A3B.sh); shape "30b-a3b-<N>l" has N of its 48 layers
QWEN3_30B_A3B_LAYER = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                           intermediate_size=6144, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)  # fmt: skip
MOE_SHAPE = re.compile(r"30b-a3b-(\d+)l")


def shape_flags(shape: str) -> dict[str, int]:
    """make_tiny_model keyword arguments of ``shape`` (a key of :data:`SHAPES` or ``30b-a3b-<N>l``)."""
    if moe := MOE_SHAPE.fullmatch(shape):
        return dict(num_layers=int(moe.group(1)), **QWEN3_30B_A3B_LAYER)
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: one of {sorted(SHAPES)} or 30b-a3b-<N>l")
    return SHAPES[shape]


# Qwen3's vocabulary (every Qwen3 size): the LM head and the [tokens, vocab] logits are part of every figure. The
# tokenizer is make_tiny_model's char vocab padded with filler tokens up to it; "tiny" keeps its own 61.
QWEN3_VOCAB_SIZE = 151936

# dense bf16 tensor-core peak by the vendor's datasheet (H100 SXM and H200 share it), for MFU
PEAK_BF16_FLOPS = 989e12
CACHE = Path(os.environ.get("VIME_BENCH_CACHE", "/tmp/vime-bench"))


def build_shape(
    shape: str, dtype: str = "bfloat16", max_position_embeddings: int = 4096, vocab_size: int | None = None
) -> Path:
    """The HF checkpoint of ``shape`` under ``$VIME_BENCH_CACHE`` (built once per machine, seed 0), with the add3
    task data for prompts; ``vocab_size`` defaults to Qwen3's (the tiny shape: its own 61)."""
    from vime.tools.make_tiny_model import VOCAB_SIZE, build_tiny_model

    vocab_size = vocab_size or (VOCAB_SIZE if shape == "tiny" else QWEN3_VOCAB_SIZE)
    out = CACHE / f"{shape}-{dtype}-vocab{vocab_size}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{out.name}.lock", "w") as lock:  # benchmarks started side by side build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").exists():
            return out
        started = time.monotonic()
        build_tiny_model(
            out,
            seed=0,
            dtype=dtype,
            max_position_embeddings=max_position_embeddings,
            vocab_size=vocab_size,
            **shape_flags(shape),
        )
    print(
        f"[bench] built {shape} ({dtype}, vocab {vocab_size}) in {time.monotonic() - started:.0f} s -> {out}",
        flush=True,
    )
    return out


def trainer_flags(backend: str, model_dir: Path) -> list[str]:
    """vime flags for a bf16 trainer of ``model_dir`` (Megatron's model flags read from its config.json)."""
    argv = ["--train-backend", backend, "--hf-checkpoint", str(model_dir), "--bf16"]
    if backend == "megatron":
        from vime.backends.megatron_utils.hf_config import flags_from_hf_config, flags_to_argv, load_hf_config

        argv += flags_to_argv(flags_from_hf_config(load_hf_config(model_dir)))
    return argv


def matmul_params(model_dir: Path) -> int:
    """Parameters that take part in matrix products per token: all but the input embedding table, and of a MoE's
    routed experts only the ``num_experts_per_tok`` of ``num_experts`` each token goes to."""
    config = json.loads((model_dir / "config.json").read_text())
    experts = config.get("num_experts") or config.get("num_local_experts") or 1
    expert_share = config.get("num_experts_per_tok", 1) / experts
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if "embed_tokens" not in name:
                    shape = f.get_slice(name).get_shape()
                    n = 1
                    for size in shape:
                        n *= size
                    total += n * expert_share if ".experts." in name else n
    return int(total)


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    """Write ``result`` (plus date and machine) as JSON, and print its one-line summary."""
    result = {"date": time.strftime("%Y-%m-%d"), "device": gpu_name(), "host": platform.node(), **result}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"[bench] {result.get('summary', '')}  -> {path}", flush=True)


def env_entries(parser: argparse.ArgumentParser, flag: str, entries: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` entries of ``flag`` as a dict; a parser error naming the malformed ones."""
    if bad := [entry for entry in entries if "=" not in entry]:
        parser.error(f"{flag} {' '.join(bad)}: expected KEY=VALUE")
    return dict(entry.split("=", 1) for entry in entries)
