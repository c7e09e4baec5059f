"""Forward FLOPs of a decoder-only model per sequence, estimated from its Hugging Face ``config.json``: what
``--balance-data`` and ``--balance-by-flops`` balance (a sequence of ``L`` tokens costs ``a·L + b·L²``: the
matmuls of every token, and causal attention's scores and weighted sums)."""

from __future__ import annotations

import functools
import json
from pathlib import Path


def flops_coefficients(config: dict) -> tuple[float, float]:
    """``(a, b)``: forward FLOPs per token and per squared token of one sequence (dense or mixture-of-experts)."""
    config = config.get("text_config", config)
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    ffn = config.get("intermediate_size", 4 * hidden)
    if config.get("moe_intermediate_size") and config.get("num_experts_per_tok"):  # routed + shared experts
        ffn = config["moe_intermediate_size"] * (
            config["num_experts_per_tok"] + config.get("n_shared_experts", 0)
        )
    projections = hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim  # q, o; k, v
    per_token = 2 * layers * (projections + 3 * hidden * ffn) + 2 * hidden * config["vocab_size"]
    per_token_squared = 2 * layers * heads * head_dim  # QK^T and AV, each half of L² under the causal mask
    return float(per_token), float(per_token_squared)


@functools.cache
def _checkpoint_coefficients(hf_checkpoint: str) -> tuple[float, float]:
    return flops_coefficients(json.loads((Path(hf_checkpoint) / "config.json").read_text(encoding="utf-8")))


def sequence_flops(lengths: list[int], hf_checkpoint: str) -> list[float]:
    """Estimated forward FLOPs of sequences of ``lengths`` tokens under the model of ``hf_checkpoint``."""
    a, b = _checkpoint_coefficients(str(hf_checkpoint))
    return [a * n + b * n * n for n in lengths]
