"""Megatron-Core configs from the Megatron flags, ``--megatron-config-path`` (YAML flag overrides, per role) and the
``--custom-megatron-*`` hook loader.

Pure (no Megatron import): the configs' fields are built as keyword dicts, so they can be checked without Megatron.
The YAML holds flag values by argparse dest or flag spelling; top-level keys apply to every role, and an
``actor:`` / ``critic:`` mapping overrides them for that role::

    lr: 1.0e-6
    recompute-granularity: full
    critic:
      lr: 1.0e-5
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vime.utils.misc import load_function

ROLE_KEYS = ("actor", "critic")


def compute_dtype(args: argparse.Namespace) -> torch.dtype:
    """bf16 with ``--bf16``, fp16 with ``--fp16``, else fp32."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def moe_layer_freq(value: int | list[int] | str) -> int | list[int]:
    """``--moe-layer-freq`` as Megatron-Core takes it: an int, or a list of 0/1 per layer from its pattern syntax."""
    if isinstance(value, (int, list)):
        return value
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        return int(text)
    # Megatron's pattern syntax, e.g. "([0]*3+[1]*43)": a list expression of integer literals only.
    tree = ast.parse(text, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Add, ast.Mult, ast.List, ast.Constant, ast.Load)
    if not all(isinstance(node, allowed) for node in ast.walk(tree)):
        raise ValueError(
            f"--moe-layer-freq {text!r}: expected an int or a list expression like '([0]*1+[1]*3)'"
        )
    return list(eval(compile(tree, "--moe-layer-freq", "eval"), {"__builtins__": {}}))  # noqa: S307


def check_mla_tensor_parallelism(args: argparse.Namespace) -> None:
    """Refuse multi-latent attention under tensor parallelism without sequence parallelism. Megatron-Core (0.19.2)
    sums every ``q_layernorm`` gradient over the TP ranks when ``qk_layernorm`` is set, yet without sequence
    parallelism each rank already holds the whole gradient of MLA's query-latent norm, so the step would use TP
    times it; and vime sums the RoPE key's gradient over TP (``model.TensorParallelMLASelfAttention``) on the
    sequence-parallel path only."""
    if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        raise ValueError(
            f"--tensor-model-parallel-size {args.tensor_model_parallel_size} with multi-latent attention needs "
            "--sequence-parallel: without it Megatron-Core sums the query-latent norm's gradient over the "
            "tensor-parallel ranks though every rank holds all of it. Add --sequence-parallel (MoE layers need it "
            "with TP anyway)."
        )


def transformer_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Megatron-Core ``TransformerConfig`` fields of the Megatron flags (dropout off: PPO ratios need a deterministic
    policy)."""
    if args.normalization != "RMSNorm":
        raise ValueError("the Megatron backend supports --normalization RMSNorm models only")
    dtype = compute_dtype(args)
    # mcore refuses its default "allgather" dispatcher with variable sequence lengths (PP > 1) even in a
    # dense model, where no dispatcher runs
    moe = {"moe_token_dispatcher_type": "alltoall"}
    if args.num_experts:
        moe = dict(
            num_moe_experts=args.num_experts,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
            moe_router_topk=args.moe_router_topk,
            moe_router_pre_softmax=args.moe_router_pre_softmax,
            moe_router_score_function=args.moe_router_score_function,
            moe_router_dtype=args.moe_router_dtype or "fp32",
            moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=args.moe_router_bias_update_rate,
            moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
            moe_router_num_groups=args.moe_router_num_groups,
            moe_router_group_topk=args.moe_router_group_topk,
            moe_router_load_balancing_type=(
                args.moe_router_load_balancing_type if args.moe_aux_loss_coeff else "none"
            ),
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            moe_layer_freq=moe_layer_freq(args.moe_layer_freq),
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            # used once an expert capacity factor drops tokens; vime sets none, so no token is dropped
            moe_token_drop_policy=args.moe_token_drop_policy,
            moe_grouped_gemm=False,  # Megatron's needs TransformerEngine; --moe-grouped-gemm: GroupedGemmExperts
            moe_permute_fusion=False,
        )
    mla = {}
    if args.multi_latent_attention:  # Megatron-Core's MLATransformerConfig (model.transformer_config)
        check_mla_tensor_parallelism(args)
        mla = dict(
            multi_latent_attention=True,
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_head_dim=args.qk_head_dim,
            qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
            v_head_dim=args.v_head_dim,
            rope_type=args.rope_type or "yarn",  # Megatron-LM's default for MLA
            rotary_base=args.rotary_base,
            rotary_percent=args.rotary_percent,
            rotary_scaling_factor=args.rotary_scaling_factor,
            mscale=args.mscale,
            mscale_all_dim=args.mscale_all_dim,
            original_max_position_embeddings=args.yarn_original_max_position_embeddings or 4096,
            beta_fast=args.yarn_beta_fast or 32.0,
            beta_slow=args.yarn_beta_slow or 1.0,
        )
    return dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else args.num_attention_heads,
        kv_channels=args.kv_channels or args.hidden_size // args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size or args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel and args.tensor_model_parallel_size > 1,
        normalization="RMSNorm",
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=args.init_method_std,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        attention_softmax_in_fp32=True,
        apply_rope_fusion=False,
        # SwiGLU as one compiled kernel that keeps only its input for backward (Megatron's swiglu fusion)
        bias_activation_fusion=args.swiglu and args.bias_swiglu_fusion,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        transformer_impl="local",
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        # vime's losses are already each micro-batch's share of the global loss: Megatron must not divide by
        # the number of micro-batches, and DDP must sum (not average) gradients over data-parallel ranks.
        calculate_per_token_loss=True,
        # packed micro-batches differ in length; only pipeline p2p needs to know (and then MoE needs alltoall)
        variable_seq_lengths=args.pipeline_model_parallel_size > 1,
        **moe,
        **mla,
    )


def ddp_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Megatron-Core ``DistributedDataParallelConfig`` fields of the Megatron flags."""
    return dict(
        # --accumulate-allreduce-grads-in-fp32; as in Megatron-LM, always on with --bf16 (Megatron-LM's way out,
        # --grad-reduce-in-bf16, is not a vime flag)
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32 or args.bf16,
        overlap_grad_reduce=False,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )


def optimizer_config_kwargs(args: argparse.Namespace, lr: float) -> dict[str, Any]:
    """Megatron-Core ``OptimizerConfig`` fields of the optimizer flags (``lr``: the role's peak learning rate).

    ``--optimizer-cpu-offload`` makes ``get_megatron_optimizer`` build its ``HybridDeviceOptimizer``: torch's AdamW on
    the CPU for ``--optimizer-offload-fraction`` of the parameters (one per parameter with
    ``--overlap-cpu-optimizer-d2h-h2d``, copies on side streams), on the GPU for the rest. With
    ``--use-precision-aware-optimizer`` (validation requires it with the offload, as Megatron-LM does) the distributed
    optimizer hands it the bf16 weight shards and their fp32 gradients, and it keeps the fp32 master weights beside
    the moments: off the GPU."""
    return dict(
        optimizer=args.optimizer,
        lr=lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        params_dtype=compute_dtype(args),
        use_distributed_optimizer=args.use_distributed_optimizer,
        optimizer_cpu_offload=args.optimizer_cpu_offload,
        # read only with the offload; the flag defaults to Megatron-LM's 1.0 (all of it), as slime passes it
        optimizer_offload_fraction=args.optimizer_offload_fraction,
        overlap_cpu_optimizer_d2h_h2d=args.overlap_cpu_optimizer_d2h_h2d,
        use_precision_aware_optimizer=args.use_precision_aware_optimizer,
    )


def role_overrides(data: dict[str, Any], role: str, where: str = "--megatron-config-path") -> dict[str, Any]:
    """The flag values for ``role`` (dests), top-level keys first, then the role's own mapping."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of flag -> value, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in ROLE_KEYS:
            continue
        out[key.lstrip("-").replace("-", "_")] = value
    section = data.get(role) or {}
    if not isinstance(section, dict):
        raise ValueError(f"{where}: '{role}:' must be a mapping of flag -> value")
    for key, value in section.items():
        out[key.lstrip("-").replace("-", "_")] = value
    return out


def role_args(args: argparse.Namespace, role: str) -> argparse.Namespace:
    """The flags of ``role``'s trainer: ``args`` with ``--megatron-config-path``'s values for ``role`` (a new
    namespace; ``args`` stay as parsed); unknown flags are an error."""
    path = args.megatron_config_path
    if not path:
        return args
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    overrides = role_overrides(data, role, f"--megatron-config-path {path}")
    unknown = sorted(dest for dest in overrides if not hasattr(args, dest))
    if unknown:
        raise ValueError(
            f"--megatron-config-path {path}: unknown flag {unknown[0]!r} (use the --flag spelling or dest)"
        )
    return argparse.Namespace(**{**vars(args), **overrides})


def load_hook(path: str | None, flag: str) -> Callable | None:
    """The function at import path ``path`` (``pkg.module.fn``), or None when unset."""
    return load_function(path, flag) if path else None
