"""The Megatron flags an HF ``config.json`` implies, and the start-up check that the flags match it.

Pure (no Megatron import). Flag values are argparse ``dest`` names of ``vime/utils/megatron_args.py``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from vime.backends.megatron_utils.config import moe_layer_freq

# multi-latent attention with DeepSeek's MoE: DeepSeek-V3/V3.1/R1, and Kimi-K2 (its config.json says kimi_k2)
MLA_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "glm4_moe", "mixtral", "deepseek_v3", "qwen3_next")


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


# families Megatron-Core 0.19 cannot build without TransformerEngine: the reason, and what it would take
MEGATRON_REFUSED = {
    "qwen3_next": (
        "Qwen3-Next's gated DeltaNet layers: Megatron-Core 0.19 has them only as "
        "megatron.core.ssm.gated_delta_net.GatedDeltaNet, which needs flash-linear-attention's Triton kernels (fla) "
        "and whose hybrid layer specs are TransformerEngine ones (its own note: 'Currently only supports "
        "transformer_engine backend'); vime's Megatron backend builds local layers without TransformerEngine. Train "
        "it with --train-backend fsdp (transformers' Qwen3NextForCausalLM). Megatron would need a local gated "
        "DeltaNet spec (column-parallel in_proj + RMSNorm, a chunked delta rule that restarts at packed-sequence "
        "boundaries) and the sigmoid output gate of the full-attention layers (--attention-output-gate)"
    ),
}


def _rope_theta(config: dict[str, Any]) -> tuple[float, dict]:
    """(theta, the RoPE parameters merged from rope_scaling and transformers 5's rope_parameters)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), {**scaling, **params, "rope_type": kind}


def _rope(config: dict[str, Any], allowed: tuple[str, ...] = ("default", "llama3")) -> tuple[float, dict]:
    theta, merged = _rope_theta(config)
    kind = merged["rope_type"]
    if kind not in allowed:
        raise ValueError(
            f"RoPE type {kind!r} (config.json): Megatron's RoPE here supports {' and '.join(allowed)} only"
        )
    if kind == "llama3" and any(float(merged.get(k, v)) != v for k, v in _MEGATRON_LLAMA3_ROPE.items()):
        raise ValueError(
            f"llama3 RoPE scaling {merged} (config.json): Megatron-Core fixes {_MEGATRON_LLAMA3_ROPE} "
            "(only the factor is a flag)"
        )
    return theta, merged


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _mla_flags(config: dict[str, Any]) -> dict[str, Any]:
    """Multi-latent attention (DeepSeek-V3, Kimi-K2): Megatron-Core's MLASelfAttention, whose RoPE is interleaved and
    whose YaRN (``--rope-type yarn``) scales cos/sin and the softmax as transformers does for the flags below."""
    if not config.get("rope_interleave", True):
        raise ValueError(
            "rope_interleave=false (config.json): Megatron-Core's multi-latent attention always applies DeepSeek's "
            "interleaved RoPE"
        )
    if config.get("q_lora_rank") is None:
        raise ValueError(
            "q_lora_rank=null (config.json, DeepSeek-V2-Lite style): Megatron-Core 0.19 builds multi-latent attention "
            "without query compression only with a fused norm+linear query projection (TransformerEngine)"
        )
    heads = config["num_attention_heads"]
    if (config.get("num_key_value_heads") or heads) != heads:
        raise ValueError(
            "multi-latent attention with num_key_value_heads != num_attention_heads (config.json)"
        )
    theta, rope = _rope(config, allowed=("default", "yarn"))
    flags: dict[str, Any] = dict(
        multi_latent_attention=True, q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=config["kv_lora_rank"],
        qk_head_dim=config["qk_nope_head_dim"], qk_pos_emb_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"], qk_layernorm=True, rotary_base=int(theta),
        rope_type="yarn" if rope["rope_type"] == "yarn" else "rope",
    )  # fmt: skip
    if rope["rope_type"] != "yarn":
        return flags
    original = rope["original_max_position_embeddings"]
    factor = float(rope.get("factor") or config["max_position_embeddings"] / original)
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim") or 0.0
    # transformers: cos/sin scale mscale(f, mscale) / mscale(f, all_dim) when both are set, else mscale(f); softmax
    # scale x mscale(f, all_dim)^2 when all_dim is set. Megatron-Core: the ratio always, and the same softmax scale.
    hf_factor = rope.get("attention_factor") or (
        _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
        if mscale and all_dim
        else _yarn_mscale(factor)
    )
    flag_mscale = float(mscale) if mscale and all_dim else 1.0
    if abs(_yarn_mscale(factor, flag_mscale) / _yarn_mscale(factor, all_dim) - hf_factor) > 1e-12:
        raise ValueError(
            f"YaRN {rope} (config.json): its cos/sin scale {hf_factor} has no Megatron --mscale/--mscale-all-dim"
        )
    if not rope.get("truncate", True):
        raise ValueError("YaRN truncate=false (config.json): Megatron-Core rounds the correction range")
    return flags | dict(
        rotary_scaling_factor=factor, mscale=flag_mscale, mscale_all_dim=float(all_dim),
        yarn_original_max_position_embeddings=int(original),
        yarn_beta_fast=float(rope.get("beta_fast") or 32), yarn_beta_slow=float(rope.get("beta_slow") or 1),
    )  # fmt: skip


def _sigmoid_router_flags(config: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-style routing (GLM-4.5, DeepSeek-V3, Kimi-K2): sigmoid scores plus an expert bias choose the top k,
    optionally inside the best groups, and the chosen scores, renormalised, are scaled. Megatron's --moe-router-pre-
    softmax does nothing with sigmoid scores, so it is not compared."""
    model_type = config.get("model_type")
    if not config.get("norm_topk_prob", True):
        raise ValueError(
            f"{model_type} with norm_topk_prob=false (config.json): Megatron always renormalises the top-k sigmoid "
            "scores"
        )
    if (
        config.get("scoring_func", "sigmoid") != "sigmoid"
        or config.get("topk_method", "noaux_tc") != "noaux_tc"
    ):
        raise ValueError(
            f"scoring_func={config.get('scoring_func')!r}, topk_method={config.get('topk_method')!r} (config.json): "
            "transformers' model routes by sigmoid scores plus the expert bias (noaux_tc) only"
        )
    groups, group_topk, topk = (
        config.get("n_group") or 1,
        config.get("topk_group") or 1,
        config["num_experts_per_tok"],
    )
    if groups > 1 and topk // group_topk != 2:
        raise ValueError(
            f"n_group={groups}, topk_group={group_topk}, num_experts_per_tok={topk} (config.json): transformers and "
            "vLLM score each expert group by its best 2 experts, Megatron-Core by its best top-k / topk_group "
            f"({topk // group_topk})"
        )
    dense, layers = config.get("first_k_dense_replace", 0), config["num_hidden_layers"]
    return dict(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        moe_router_num_groups=config.get("n_group"), moe_router_group_topk=config.get("topk_group"),
        moe_shared_expert_intermediate_size=config["moe_intermediate_size"] * config.get("n_shared_experts", 1),
        moe_layer_freq=f"([0]*{dense}+[1]*{layers - dense})",
    )  # fmt: skip


def _softmax_router_flags(config: dict[str, Any]) -> dict[str, Any]:
    """Qwen-style routing: HF softmaxes over all experts then takes the top k, renormalising them with
    norm_topk_prob. Megatron: pre_softmax -> the same without renormalising; otherwise a softmax over the top-k
    logits, which equals the renormalised top-k probabilities."""
    flags: dict[str, Any] = dict(
        moe_router_score_function="softmax", moe_router_pre_softmax=not config.get("norm_topk_prob", False)
    )
    sparse_step = config.get("decoder_sparse_step", 1)
    mlp_only = set(config.get("mlp_only_layers") or [])
    if sparse_step != 1 or mlp_only:
        pattern = [
            int(i not in mlp_only and (i + 1) % sparse_step == 0) for i in range(config["num_hidden_layers"])
        ]
        flags["moe_layer_freq"] = f"{pattern}"
    return flags


def flags_from_hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """The Megatron flag values (argparse dests) that reproduce the HF model ``config``; ``ValueError`` naming the
    reason for a model vime's Megatron backend cannot reproduce."""
    model_type = config.get("model_type", "")
    if model_type in MEGATRON_REFUSED:
        raise ValueError(
            f"model_type {model_type} (config.json) on the Megatron backend: {MEGATRON_REFUSED[model_type]}"
        )
    if config.get("use_sliding_window"):
        raise ValueError(
            "use_sliding_window=true (config.json): vime's packed attention attends to whole sequences; Megatron "
            "would not reproduce the window"
        )
    heads = config["num_attention_heads"]
    mla = model_type in MLA_MODEL_TYPES
    theta, rope = _rope_theta(config) if mla else _rope(config)
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
        "rotary_percent": float(config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))),
        "normalization": "RMSNorm",
        "norm_epsilon": config.get("rms_norm_eps", 1e-6),
        "swiglu": config.get("hidden_act", "silu") == "silu",
        "add_bias_linear": False,
        "add_qkv_bias": bool(config.get("attention_bias", model_type == "qwen2")),
        "qk_layernorm": model_type in ("qwen3", "qwen3_moe") or bool(config.get("use_qk_norm", False)),
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "vocab_size": config["vocab_size"],
        "use_rope_scaling": rope["rope_type"] == "llama3",
        "multi_latent_attention": False,
    }
    if mla:  # no per-head q/k/v: the MLA sizes replace kv_channels
        del flags["kv_channels"]
        flags |= _mla_flags(config)
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
        sigmoid = model_type in ("glm4_moe", *MLA_MODEL_TYPES)
        flags |= _sigmoid_router_flags(config) if sigmoid else _softmax_router_flags(config)
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
    if value is None and dest in _MEGATRON_DEFAULTS:
        return _MEGATRON_DEFAULTS[dest](args)
    if dest == "moe_layer_freq":  # a pattern, however spelled: "([0]*1+[1]*3)", "[0,1,1,1]", 1
        return _layer_pattern(value, args.num_layers)
    return value


# what Megatron-Core uses for a flag left unset
_MEGATRON_DEFAULTS = {
    "rope_type": lambda args: "yarn" if args.multi_latent_attention else "rope",
    "yarn_original_max_position_embeddings": lambda args: 4096,
    "yarn_beta_fast": lambda args: 32.0,
    "yarn_beta_slow": lambda args: 1.0,
}


def _layer_pattern(value: Any, num_layers: int | None) -> Any:
    freq = moe_layer_freq(value)
    if isinstance(freq, int) and num_layers:
        return [int(i % freq == 0) for i in range(num_layers)]
    return freq


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
        if dest == "moe_layer_freq":
            want = _layer_pattern(want, args.num_layers)
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
