"""The Megatron-named flags per ``--train-backend``: each is implemented, mapped to what the backend has, or refused
with the reason (a ``scripts/models/*.sh`` MODEL_ARGS line is taken by both backends, so nothing is silently ignored).
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)

# Megatron-LM flags (in MODEL_ARGS scripts) that vime's Megatron backend does not implement: refused when set.
MEGATRON_UNSUPPORTED = {
    "decoder_first_pipeline_num_layers": "uneven pipeline stages (vime splits the layers evenly)",
    "decoder_last_pipeline_num_layers": "uneven pipeline stages (vime splits the layers evenly)",
}
# flags that describe Qwen3-Next / Qwen3.5 (gated DeltaNet hybrids): the fsdp backend takes the model from config.json;
# the Megatron backend cannot build it (hf_config.MEGATRON_REFUSED says why)
GATED_DELTANET_FLAGS = (
    "apply_layernorm_1p",
    "attention_output_gate",
    "use_gated_attention",
    "moe_shared_expert_gate",
)
# TransformerEngine fusions whose unfused form is what vime runs anyway: the same result, an info line
UNFUSED_ANYWAY = {
    "moe_permute_fusion": "permutes tokens with Megatron-Core's unfused code (same permutation)",
}

# Megatron-Core's attention backends (its AttnBackend): fused and unfused pick TransformerEngine kernels.
ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
_TE_ATTENTION = {"fused": "cuDNN fused attention", "unfused": "unfused attention"}
VIME_ATTENTION = (
    "vime runs its own packed attention on either backend (FlashAttention-2's varlen kernels on CUDA in bf16, "
    "PyTorch SDPA otherwise), without TransformerEngine"
)


def check_backend_flags(args: argparse.Namespace) -> None:
    """Refuse the Megatron flags the chosen backend cannot honour, and map the ones it can (ValueError naming the
    flag, the reason and the fix)."""
    if used := [dest for dest in MEGATRON_UNSUPPORTED if getattr(args, dest, None) not in (None, False)]:
        raise ValueError(
            "; ".join(
                f"--{d.replace('_', '-')}: vime's Megatron backend has no {MEGATRON_UNSUPPORTED[d]}"
                for d in used
            )
            + "; drop the flag"
        )
    if args.ckpt_format != "torch_dist":
        raise ValueError(
            f"--ckpt-format {args.ckpt_format}: vime writes Megatron checkpoints as torch_dist only"
        )
    dropout = {"--attention-dropout": args.attention_dropout, "--hidden-dropout": args.hidden_dropout}
    if dropout := [f"{flag} {value}" for flag, value in dropout.items() if value]:
        raise ValueError(
            f"{', '.join(dropout)}: vime trains without dropout (the engines run none, so dropout would make the "
            "trainer's log-probs differ from the rollout's and bias the importance ratios); pass 0 or drop the flag"
        )
    if args.mtp_num_layers:
        raise ValueError(
            f"--mtp-num-layers {args.mtp_num_layers}: vime does not train multi-token-prediction layers (a "
            "checkpoint's MTP weights are left out of training and of the weight sync); drop the flag"
        )
    _check_layer_implementation(args)
    _check_model_family_flags(args)
    _check_recompute(args)
    _check_optimizer_offload(args)
    if args.train_backend == "fsdp":
        _check_fsdp(args)


def _check_layer_implementation(args: argparse.Namespace) -> None:
    if args.transformer_impl != "local":
        raise ValueError(
            f"--transformer-impl {args.transformer_impl}: vime builds Megatron-Core's local layers with its own "
            "packed attention and norms (TransformerEngine is not a dependency); pass --transformer-impl local or "
            "drop the flag"
        )
    backend = getattr(args.attention_backend, "name", args.attention_backend)  # Megatron-LM's parser: an enum
    if backend in _TE_ATTENTION:
        raise ValueError(
            f"--attention-backend {backend}: TransformerEngine's {_TE_ATTENTION[backend]}, which vime does not use: "
            f"{VIME_ATTENTION}. Pass --attention-backend flash (or auto) or drop the flag"
        )
    if backend != "auto":
        logger.info("--attention-backend %s: %s", backend, VIME_ATTENTION)


def _check_model_family_flags(args: argparse.Namespace) -> None:
    """slime's model-script flags for the families vime trains: TransformerEngine fusions vime does not need, the
    layer-spec plug-in, and the gated DeltaNet families the Megatron backend cannot build."""
    if args.moe_permute_fusion:
        logger.info(
            "--moe-permute-fusion: vime permutes tokens with Megatron-Core's unfused code (same permutation)"
        )
    if not args.apply_rope_fusion:
        logger.info("--no-rope-fusion: vime applies RoPE unfused either way (no TransformerEngine)")
    rope = args.position_embedding_type == "rope" or args.use_rotary_position_embeddings
    if not args.add_position_embedding and not rope:
        raise ValueError(
            "--no-position-embedding without --position-embedding-type rope: vime's models need a position "
            "embedding; pass --position-embedding-type rope (as the model scripts do)"
        )
    if args.train_backend == "fsdp":
        if args.spec:
            logger.info(
                "--spec %s: the fsdp backend builds transformers' own model class from config.json", args.spec
            )
        return
    if args.spec:
        raise ValueError(
            f"--spec {' '.join(args.spec)}: vime's Megatron backend builds its own layer specs (local layers with its "
            "packed attention); drop the flag, or pass --custom-model-provider-path"
        )
    # the fsdp backend takes these models from config.json; hf_config.MEGATRON_REFUSED says why Megatron cannot
    gated_deltanet = {
        "--apply-layernorm-1p": args.apply_layernorm_1p,
        "--attention-output-gate": args.attention_output_gate,
        "--use-gated-attention": args.use_gated_attention,
        "--moe-shared-expert-gate": args.moe_shared_expert_gate,
    }
    if used := [flag for flag, value in gated_deltanet.items() if value]:
        raise ValueError(
            f"{', '.join(used)}: flags of Qwen3-Next / Qwen3.5, whose gated "
            "DeltaNet layers Megatron-Core 0.19 builds only with TransformerEngine and flash-linear-attention; train "
            "them with --train-backend fsdp"
        )


def _check_recompute(args: argparse.Namespace) -> None:
    """Megatron-Core's rules for the recompute flags, checked at parse time for both backends; slime's scripts pass
    ``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``."""
    granularity, method, layers = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    if args.gradient_checkpointing:
        if granularity is not None:
            raise ValueError(
                f"--gradient-checkpointing with --recompute-granularity {granularity}: --gradient-checkpointing is "
                "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1; pass one of them"
            )
        args.recompute_granularity, args.recompute_method, args.recompute_num_layers = "full", "uniform", 1
        return
    if granularity != "full" and (method is not None or layers is not None):
        given = " ".join(
            f"{flag} {value}"
            for flag, value in (("--recompute-method", method), ("--recompute-num-layers", layers))
            if value is not None
        )
        raise ValueError(
            f"{given}: these choose the layers of --recompute-granularity full only (Megatron-Core ignores "
            f"them with {granularity or 'no recompute'}); add --recompute-granularity full or drop them"
        )
    if granularity == "full" and (method is None or layers is None or layers < 1):
        raise ValueError(
            f"--recompute-granularity full with --recompute-method {method} --recompute-num-layers {layers}: "
            "Megatron-Core needs both, a method (uniform or block) and a layer count >= 1; e.g. "
            "--recompute-method uniform --recompute-num-layers 1 (every layer)"
        )


def _check_fsdp(args: argparse.Namespace) -> None:
    """The fsdp backend shards over data-parallel ranks only and checkpoints whole Hugging Face decoder layers."""
    parallel = {
        "--tensor-model-parallel-size": args.tensor_model_parallel_size,
        "--pipeline-model-parallel-size": args.pipeline_model_parallel_size,
        "--context-parallel-size": args.context_parallel_size,
        "--expert-model-parallel-size": args.expert_model_parallel_size,
        "--expert-tensor-parallel-size": args.expert_tensor_parallel_size or 1,
    }
    used = [f"{flag} {size}" for flag, size in parallel.items() if size > 1]
    used += ["--sequence-parallel"] * bool(args.sequence_parallel)
    if used:
        raise ValueError(
            f"{', '.join(used)}: the fsdp backend shards over data-parallel ranks only; these are Megatron "
            "flags (use --train-backend megatron)"
        )
    megatron_hooks = {
        "--custom-megatron-init-path": args.custom_megatron_init_path,
        "--custom-megatron-before-log-prob-hook-path": args.custom_megatron_before_log_prob_hook_path,
        "--custom-megatron-before-train-step-hook-path": args.custom_megatron_before_train_step_hook_path,
        "--megatron-config-path": args.megatron_config_path,
    }
    if used := [flag for flag, value in megatron_hooks.items() if value]:
        raise ValueError(
            f"{', '.join(used)}: hooks and per-role flags of the Megatron backend, which the fsdp backend never "
            "calls or reads; drop them or use --train-backend megatron"
        )
    if args.recompute_granularity == "selective":
        raise ValueError(
            "--recompute-granularity selective: Megatron's recompute of core attention only; the fsdp backend "
            "checkpoints whole decoder layers. Use --recompute-granularity full --recompute-method uniform "
            "--recompute-num-layers 1 (or --gradient-checkpointing), or --train-backend megatron"
        )
    if args.recompute_method == "uniform" and args.recompute_num_layers != 1:
        raise ValueError(
            f"--recompute-method uniform --recompute-num-layers {args.recompute_num_layers}: the fsdp backend "
            "checkpoints each decoder layer on its own, not groups of layers; use --recompute-num-layers 1 (every "
            "layer), or --recompute-method block N (the first N layers)"
        )
    if args.use_distributed_optimizer:
        logger.info(
            "--use-distributed-optimizer: the fsdp backend always shards the optimizer state (with the parameters "
            "and gradients) over the data-parallel ranks"
        )


def _check_optimizer_offload(args: argparse.Namespace) -> None:
    """slime's CPU optimizer flags, as Megatron-LM validates them for slime: the Megatron backend builds
    Megatron-Core's hybrid CPU/GPU optimizer (``HybridDeviceOptimizer``) from them; the fsdp backend refuses them."""
    offload, overlap = args.optimizer_cpu_offload, args.overlap_cpu_optimizer_d2h_h2d
    precision_aware, fraction = args.use_precision_aware_optimizer, args.optimizer_offload_fraction
    given = [
        flag
        for flag, on in (
            ("--optimizer-cpu-offload", offload),
            ("--overlap-cpu-optimizer-d2h-h2d", overlap),
            ("--use-precision-aware-optimizer", precision_aware),
            (f"--optimizer-offload-fraction {fraction}", fraction != 1.0),
        )
        if on
    ]
    if given and args.train_backend == "fsdp":
        raise ValueError(
            f"{', '.join(given)}: Megatron-Core's hybrid CPU/GPU optimizer, which the fsdp backend does not have "
            "(FSDP2's CPUOffloadPolicy would move the parameters and gradients to the CPU too, a different trade "
            "vime does not offer); use --train-backend megatron, or --offload-train to free the training GPU "
            "memory while the engines generate"
        )
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(
            f"--optimizer-offload-fraction {fraction}: the share of the parameters (by size) whose optimizer state "
            "and step are on the CPU, from 0 to 1 (1, the default: all of them)"
        )
    if not offload:
        if overlap or fraction != 1.0:
            raise ValueError(
                f"{', '.join(given)} without --optimizer-cpu-offload: these tune the CPU optimizer, which only "
                "--optimizer-cpu-offload turns on; add it or drop them"
            )
        if precision_aware:
            raise ValueError(
                "--use-precision-aware-optimizer without --optimizer-cpu-offload: on the GPU, Megatron-Core's "
                "precision-aware optimizer is TransformerEngine's FusedAdam (master weights and decoupled "
                "gradients inside the Adam kernel), and vime runs without TransformerEngine; add "
                "--optimizer-cpu-offload (Megatron-Core's hybrid CPU optimizer implements it in PyTorch, as in "
                "slime's recipes) or drop the flag"
            )
        return
    missing = []
    if not precision_aware:
        missing.append(
            "--use-precision-aware-optimizer (Megatron-LM, which validates slime's flags, requires the pair: on that "
            "path the hybrid optimizer holds the fp32 master weights itself; without it they stay on the GPU in the "
            "distributed optimizer, and a weight reload reaches neither them nor the optimizer's CPU copies)"
        )
    if not args.bf16:
        missing.append(
            "--bf16 (Megatron-Core 0.19's hybrid optimizer keeps fp32 master copies of bf16 weights only: with fp32 "
            "weights its checkpoint load fails and a weight reload misses its CPU copies; slime always trains in "
            "bf16)"
        )
    if missing:
        raise ValueError(f"--optimizer-cpu-offload needs {' and '.join(missing)}; add them")
    if args.optimizer != "adam":
        raise ValueError(
            f"--use-precision-aware-optimizer with --optimizer {args.optimizer}: Megatron-Core's precision-aware "
            "optimizer is Adam only; use --optimizer adam"
        )
    if not args.use_distributed_optimizer:
        logger.info(
            "--use-precision-aware-optimizer: turns on --use-distributed-optimizer (Megatron-Core's precision-aware "
            "path lives in its distributed optimizer; slime always uses it)"
        )
        args.use_distributed_optimizer = True
