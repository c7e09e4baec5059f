"""The Megatron flags an HF ``config.json`` implies, and the start-up check that the flags match it.

Pure (no Megatron import). Flag values are argparse ``dest`` names of ``vime/utils/megatron_args.py``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "glm4_moe", "mixtral")


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """``path/config.json`` as a dict (``path`` may also be the file)."""
    file = Path(path)
    file = file / "config.json" if file.is_dir() else file
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: --hf-checkpoint must be an HF model directory")
    return json.loads(file.read_text())


# what Megatron-Core's llama3 RoPE scaling hard-codes (RotaryEmbedding._apply_scaling)
_MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192.0,
}


def _rope(config: dict) -> tuple[float, dict]:
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    merged = {**scaling, **params, "rope_type": kind}
    if kind not in ("default", "llama3"):
        raise ValueError(
            f"RoPE type {kind!r} (config.json): Megatron's RoPE here supports default and llama3 only"
        )
    if kind == "llama3" and any(float(merged.get(k, v)) != v for k, v in _MEGATRON_LLAMA3_ROPE.items()):
        raise ValueError(
            f"llama3 RoPE scaling {merged} (config.json): Megatron-Core fixes {_MEGATRON_LLAMA3_ROPE} "
            "(only the factor is a flag)"
        )
    return float(theta), merged


def flags_from_hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """The Megatron flag values (argparse dests) that reproduce the HF model ``config``."""
    model_type = config.get("model_type", "")
    heads = config["num_attention_heads"]
    theta, rope = _rope(config)
    flags: dict[str, Any] = {
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "ffn_hidden_size": config["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": config.get("num_key_value_heads") or heads,
        "kv_channels": config.get("head_dim") or config["hidden_size"] // heads,
        "max_position_embeddings": config.get("max_position_embeddings"),
        "position_embedding_type": "rope",
        "rotary_base": int(theta),
        "rotary_percent": float(config.get("partial_rotary_factor", 1.0)),
        "normalization": "RMSNorm",
        "norm_epsilon": config.get("rms_norm_eps", 1e-6),
        "swiglu": config.get("hidden_act", "silu") == "silu",
        "add_bias_linear": False,
        "add_qkv_bias": bool(config.get("attention_bias", model_type == "qwen2")),
        "qk_layernorm": model_type in ("qwen3", "qwen3_moe") or bool(config.get("use_qk_norm", False)),
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "vocab_size": config["vocab_size"],
        "use_rope_scaling": rope["rope_type"] == "llama3",
    }
    flags["group_query_attention"] = flags["num_query_groups"] != heads
    if flags["use_rope_scaling"]:
        flags["rope_scaling_factor"] = float(rope.get("factor", 8.0))
    num_experts = (
        config.get("num_experts") or config.get("n_routed_experts") or config.get("num_local_experts")
    )
    if num_experts:
        flags.update(
            num_experts=num_experts,
            moe_ffn_hidden_size=config.get("moe_intermediate_size", config["intermediate_size"]),
            moe_router_topk=config["num_experts_per_tok"],
        )
        if model_type == "glm4_moe":
            if not config.get("norm_topk_prob", True):
                raise ValueError(
                    "glm4_moe with norm_topk_prob=false (config.json): Megatron always renormalises the top-k "
                    "sigmoid scores"
                )
            dense = config.get("first_k_dense_replace", 0)
            flags.update(
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
                moe_router_pre_softmax=False,
                moe_router_topk_scaling_factor=config.get("routed_scaling_factor", 1.0),
                moe_router_num_groups=config.get("n_group"),
                moe_router_group_topk=config.get("topk_group"),
                moe_shared_expert_intermediate_size=config["moe_intermediate_size"]
                * config.get("n_shared_experts", 1),
                moe_layer_freq=f"([0]*{dense}+[1]*{config['num_hidden_layers'] - dense})",
            )
        else:
            # HF softmaxes over all experts then takes the top k, renormalising them with norm_topk_prob.
            # Megatron: pre_softmax -> the same without renormalising; otherwise a softmax over the top-k logits,
            # which equals the renormalised top-k probabilities.
            flags.update(
                moe_router_score_function="softmax",
                moe_router_pre_softmax=not config.get("norm_topk_prob", False),
            )
            sparse_step = config.get("decoder_sparse_step", 1)
            mlp_only = set(config.get("mlp_only_layers") or [])
            if sparse_step != 1 or mlp_only:
                pattern = [
                    int(i not in mlp_only and (i + 1) % sparse_step == 0)
                    for i in range(config["num_hidden_layers"])
                ]
                flags["moe_layer_freq"] = f"{pattern}"
    return flags


def _effective(args: argparse.Namespace, dest: str) -> Any:
    """The value Megatron will use for ``dest`` (its defaults for unset sizes)."""
    value = getattr(args, dest, None)
    if dest == "ffn_hidden_size" and value is None and args.hidden_size:
        return 4 * args.hidden_size
    if dest == "kv_channels" and value is None and args.hidden_size and args.num_attention_heads:
        return args.hidden_size // args.num_attention_heads
    if dest == "num_query_groups" and not getattr(args, "group_query_attention", False):
        return args.num_attention_heads
    if dest == "position_embedding_type" and getattr(args, "use_rotary_position_embeddings", False):
        return "rope"
    return value


# flags whose mismatch is not an error when the user left them unset (None)
_OPTIONAL = {"max_position_embeddings", "vocab_size"}
# flags not compared (derived or only relevant for another flag's value)
_SKIP = {"group_query_attention"}


def check_hf_config(args: argparse.Namespace, config: dict[str, Any], where: str = "config.json") -> None:
    """Raise ``ValueError`` naming every Megatron flag that disagrees with the HF ``config``."""
    problems = []
    for dest, want in flags_from_hf_config(config).items():
        if dest in _SKIP:
            continue
        have = _effective(args, dest)
        if have is None and dest in _OPTIONAL:
            continue
        if (
            isinstance(want, float)
            and isinstance(have, (int, float))
            and abs(have - want) <= 1e-12 * abs(want)
        ):
            continue
        if have != want:
            flag = "--" + dest.replace("_", "-")
            if dest == "add_bias_linear":
                flag = "--disable-bias-linear (add_bias_linear)"
            problems.append(f"{flag}={have!r} but {where} implies {want!r}")
    if problems:
        raise ValueError(
            "the Megatron model flags do not match the HF checkpoint:\n  "
            + "\n  ".join(problems)
            + "\nfix MODEL_ARGS (scripts/models/*.sh) or --hf-checkpoint"
        )


def flags_to_argv(flags: dict[str, Any]) -> list[str]:
    """Turn :func:`flags_from_hf_config` output into command-line flags (for tools and tests)."""
    argv: list[str] = []
    for dest, value in flags.items():
        if value is None:
            continue
        if dest == "add_bias_linear":
            argv += [] if value else ["--disable-bias-linear"]
            continue
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    return argv
