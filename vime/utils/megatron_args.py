"""Megatron-named flags: Megatron-LM's own parser when installed, else vime's copy of the ones it uses.

Both trainers read these (model shape, parallelism, optimizer, schedule, precision, checkpoints), so a
``scripts/models/*.sh`` MODEL_ARGS line works with or without Megatron-LM. Names and defaults follow
Megatron-LM, so flags mean the same thing either way.
"""

from __future__ import annotations

import argparse
import importlib
import os

_NO_DROPOUT = "0 in vime (Megatron-LM's default is 0.1); any other value is refused"

_MODEL = [
    ("--num-layers", dict(type=int, default=None, help="Number of transformer layers.")),
    ("--hidden-size", dict(type=int, default=None, help="Transformer hidden size.")),
    ("--ffn-hidden-size", dict(type=int, default=None, help="FFN hidden size (default 4*hidden).")),
    ("--num-attention-heads", dict(type=int, default=None, help="Number of attention heads.")),
    ("--kv-channels", dict(type=int, default=None, help="Head dim (default hidden/heads).")),
    ("--group-query-attention", dict(action="store_true", help="Use grouped-query attention.")),
    ("--num-query-groups", dict(type=int, default=1, help="KV heads when GQA is on.")),
    ("--max-position-embeddings", dict(type=int, default=None, help="Position embedding size.")),
    ("--seq-length", dict(type=int, default=None, help="Max sequence length for training.")),
    (
        "--position-embedding-type",
        dict(
            default="learned_absolute",
            choices=["learned_absolute", "rope", "none"],
            help="Position embedding type.",
        ),
    ),
    (
        "--use-rotary-position-embeddings",
        dict(action="store_true", help="Use RoPE (same as --position-embedding-type rope)."),
    ),
    ("--rotary-base", dict(type=int, default=10000, help="RoPE base.")),
    ("--rotary-percent", dict(type=float, default=1.0, help="Fraction of head dim that gets RoPE.")),
    ("--use-rope-scaling", dict(action="store_true", help="Llama-3.x RoPE scaling.")),
    ("--rope-scaling-factor", dict(type=float, default=8.0, help="RoPE scaling factor.")),
    ("--normalization", dict(default="LayerNorm", choices=["LayerNorm", "RMSNorm"], help="Norm type.")),
    ("--norm-epsilon", dict(type=float, default=1e-5, help="Norm epsilon.")),
    ("--swiglu", dict(action="store_true", help="Use SwiGLU MLPs.")),
    (
        "--no-bias-swiglu-fusion",
        dict(
            action="store_false",
            dest="bias_swiglu_fusion",
            help="Run SwiGLU unfused (default: one torch.compile'd kernel, as in Megatron-LM).",
        ),
    ),
    (
        "--disable-bias-linear",
        dict(action="store_false", dest="add_bias_linear", help="No bias in linear layers."),
    ),
    ("--add-qkv-bias", dict(action="store_true", help="Bias on QKV only (Qwen2, GLM).")),
    ("--qk-layernorm", dict(action="store_true", help="Norm on Q and K (Qwen3).")),
    ("--untie-embeddings-and-output-weights", dict(action="store_true", help="Separate output layer.")),
    ("--vocab-size", dict(type=int, default=None, help="Vocabulary size (padded by the model).")),
    ("--make-vocab-size-divisible-by", dict(type=int, default=128, help="Pad vocab to a multiple of this.")),
    ("--init-method-std", dict(type=float, default=0.02, help="Init std.")),
    ("--attention-dropout", dict(type=float, default=0.0, help=f"Attention dropout: {_NO_DROPOUT}.")),
    ("--hidden-dropout", dict(type=float, default=0.0, help=f"Hidden dropout: {_NO_DROPOUT}.")),
    (
        "--attention-backend",
        dict(
            default="auto",
            choices=["flash", "fused", "unfused", "local", "auto"],
            help="Megatron-Core's attention backend. vime runs its own packed attention (FlashAttention-2 varlen on "
            "CUDA in bf16, SDPA otherwise) on both backends: flash, local and auto are accepted (one info line); "
            "fused and unfused pick TransformerEngine kernels and are refused.",
        ),
    ),
    (
        "--transformer-impl",
        dict(
            default="local",
            choices=["local", "transformer_engine"],
            help="Layer implementation: local (Megatron-Core's own layers; vime has no TransformerEngine, so "
            "transformer_engine, Megatron-LM's default, is refused).",
        ),
    ),
    # multi-latent attention (DeepSeek-V3, Kimi-K2): Megatron-Core's MLASelfAttention, names and defaults as Megatron-LM
    (
        "--multi-latent-attention",
        dict(action="store_true", help="Multi-latent attention (DeepSeek-V3, Kimi-K2)."),
    ),
    (
        "--q-lora-rank",
        dict(type=int, default=None, help="MLA query compression rank (None: no compression)."),
    ),
    ("--kv-lora-rank", dict(type=int, default=32, help="MLA key/value latent rank.")),
    ("--qk-head-dim", dict(type=int, default=128, help="MLA query/key head size without RoPE.")),
    ("--qk-pos-emb-head-dim", dict(type=int, default=64, help="MLA decoupled RoPE head size.")),
    ("--v-head-dim", dict(type=int, default=128, help="MLA value head size.")),
    (
        "--rope-type",
        dict(default=None, choices=["rope", "yarn"], help="MLA's RoPE (default yarn, as Megatron-LM's)."),
    ),
    ("--rotary-scaling-factor", dict(type=float, default=1.0, help="MLA YaRN scaling factor.")),
    ("--mscale", dict(type=float, default=1.0, help="MLA YaRN mscale.")),
    ("--mscale-all-dim", dict(type=float, default=0.0, help="MLA YaRN mscale_all_dim.")),
    (
        "--yarn-original-max-position-embeddings",
        dict(type=int, default=None, help="YaRN's pre-scaling context (default 4096)."),
    ),
    ("--yarn-beta-fast", dict(type=float, default=None, help="YaRN beta_fast (default 32).")),
    ("--yarn-beta-slow", dict(type=float, default=None, help="YaRN beta_slow (default 1).")),
    (
        "--no-rope-fusion",
        dict(
            action="store_false",
            dest="apply_rope_fusion",
            help="Unfused RoPE: what vime always runs (TransformerEngine's fused RoPE is not a dependency).",
        ),
    ),
    (
        "--no-position-embedding",
        dict(
            action="store_false",
            dest="add_position_embedding",
            help="No learned absolute position embedding (Megatron-LM's deprecated spelling; with "
            "--position-embedding-type rope it changes nothing).",
        ),
    ),
    # Qwen3-Next / Qwen3.5 (gated DeltaNet hybrids): the fsdp backend takes them from config.json; refused on
    # Megatron, which has no gated DeltaNet without TransformerEngine and flash-linear-attention
    ("--apply-layernorm-1p", dict(action="store_true", help="Norms scale by 1 + weight (Qwen3-Next).")),
    (
        "--attention-output-gate",
        dict(action="store_true", help="Sigmoid-gated attention output (Qwen3-Next)."),
    ),
    ("--use-gated-attention", dict(action="store_true", help="slime's name for --attention-output-gate.")),
    (
        "--spec",
        dict(
            nargs="*",
            default=None,
            help="Megatron-LM's layer-spec provider (module function); vime builds its own layer specs.",
        ),
    ),
    (
        "--mtp-num-layers",
        dict(
            type=int,
            default=None,
            help="Multi-token-prediction layers: not trained by vime (refused if > 0).",
        ),
    ),
]

_MOE = [
    ("--num-experts", dict(type=int, default=None, help="Number of routed experts.")),
    ("--moe-ffn-hidden-size", dict(type=int, default=None, help="Expert FFN hidden size.")),
    ("--moe-shared-expert-intermediate-size", dict(type=int, default=None, help="Shared expert size.")),
    ("--moe-router-topk", dict(type=int, default=2, help="Experts per token.")),
    (
        "--moe-shared-expert-gate",
        dict(action="store_true", help="Sigmoid gate on the shared expert (Qwen3-Next)."),
    ),
    (
        "--moe-router-score-function",
        dict(default="softmax", choices=["softmax", "sigmoid"], help="Router score function."),
    ),
    ("--moe-router-dtype", dict(default=None, choices=["fp32", "fp64"], help="Router compute dtype.")),
    ("--moe-router-pre-softmax", dict(action="store_true", help="Softmax before top-k.")),
    ("--moe-router-enable-expert-bias", dict(action="store_true", help="Aux-loss-free expert bias.")),
    ("--moe-router-bias-update-rate", dict(type=float, default=1e-3, help="Expert bias update rate.")),
    ("--moe-router-topk-scaling-factor", dict(type=float, default=None, help="Top-k weight scale.")),
    (
        "--moe-router-num-groups",
        dict(type=int, default=None, help="Expert groups for group-limited routing."),
    ),
    ("--moe-router-group-topk", dict(type=int, default=None, help="Groups chosen per token.")),
    ("--moe-router-load-balancing-type", dict(default="aux_loss", help="Load-balancing type.")),
    ("--moe-aux-loss-coeff", dict(type=float, default=0.0, help="Aux loss coefficient.")),
    ("--moe-layer-freq", dict(default="1", help="MoE layer pattern, e.g. '([0]*1+[1]*45)'.")),
    (
        "--moe-grouped-gemm",
        dict(
            action="store_true",
            help="Each MoE layer's expert weights kept stacked (one parameter per projection; names, HF mapping "
            "and torch_dist checkpoints stay per expert) and run as two grouped GEMMs (torch grouped_mm, no "
            "TransformerEngine) in CUDA bf16 with expert TP 1; otherwise the experts run one by one.",
        ),
    ),
    (
        "--moe-token-dispatcher-type",
        dict(default="allgather", choices=["allgather", "alltoall", "flex"], help="Token dispatcher."),
    ),
    (
        "--moe-token-drop-policy",
        dict(
            default="probs",
            choices=["probs", "position"],
            help="Which tokens Megatron-Core drops past an expert's capacity (passed to its config); vime sets no "
            "capacity factor, so no token is dropped.",
        ),
    ),
    ("--moe-permute-fusion", dict(action="store_true", help="Fused token permutation.")),
]

_PARALLEL = [
    ("--tensor-model-parallel-size", dict(type=int, default=1, help="TP size.")),
    ("--pipeline-model-parallel-size", dict(type=int, default=1, help="PP size.")),
    ("--context-parallel-size", dict(type=int, default=1, help="CP size.")),
    ("--expert-model-parallel-size", dict(type=int, default=1, help="EP size.")),
    ("--expert-tensor-parallel-size", dict(type=int, default=None, help="TP size inside experts.")),
    ("--sequence-parallel", dict(action="store_true", help="Sequence parallelism (with TP).")),
    (
        "--decoder-first-pipeline-num-layers",
        dict(type=int, default=None, help="Layers on the first PP stage."),
    ),
    ("--decoder-last-pipeline-num-layers", dict(type=int, default=None, help="Layers on the last PP stage.")),
    (
        "--use-distributed-optimizer",
        dict(
            action="store_true",
            help="Shard optimizer state over DP (Megatron); the fsdp backend always does (one info line).",
        ),
    ),
    (
        "--recompute-granularity",
        dict(
            default=None,
            choices=["full", "selective"],
            help="Activation recompute: full (whole layers; with --recompute-method and --recompute-num-layers) or "
            "selective (core attention; Megatron backend only). fsdp: full checkpoints Hugging Face decoder layers.",
        ),
    ),
    (
        "--recompute-method",
        dict(
            default=None,
            choices=["uniform", "block"],
            help="Which layers full recompute covers: uniform (groups of --recompute-num-layers; fsdp: 1 only, "
            "every layer) or block (the first --recompute-num-layers layers of each pipeline stage).",
        ),
    ),
    (
        "--recompute-num-layers",
        dict(type=int, default=None, help="Layers per recompute group, or per block."),
    ),
    (
        "--distributed-backend",
        dict(
            default=None,
            choices=["nccl", "gloo"],
            help="torch.distributed backend; vime picks nccl on GPUs, gloo on CPUs (a different value is refused).",
        ),
    ),
    ("--distributed-timeout-minutes", dict(type=int, default=10, help="Collective timeout.")),
]

_OPTIM = [
    ("--optimizer", dict(default="adam", choices=["adam", "sgd"], help="Optimizer (adam = AdamW).")),
    ("--lr", dict(type=float, default=1e-6, help="Peak learning rate.")),
    ("--min-lr", dict(type=float, default=0.0, help="Minimum learning rate.")),
    (
        "--lr-decay-style",
        dict(
            default="constant",
            choices=["constant", "linear", "cosine", "inverse-square-root"],
            help="Decay schedule.",
        ),
    ),
    ("--lr-decay-iters", dict(type=int, default=None, help="Steps to decay over (default: all).")),
    ("--lr-warmup-iters", dict(type=int, default=0, help="Linear warm-up steps.")),
    ("--lr-warmup-fraction", dict(type=float, default=None, help="Warm-up as a fraction of decay steps.")),
    ("--lr-warmup-init", dict(type=float, default=0.0, help="LR at the start of warm-up.")),
    ("--weight-decay", dict(type=float, default=0.01, help="Decoupled weight decay.")),
    ("--adam-beta1", dict(type=float, default=0.9, help="Adam beta1.")),
    ("--adam-beta2", dict(type=float, default=0.999, help="Adam beta2.")),
    ("--adam-eps", dict(type=float, default=1e-8, help="Adam epsilon.")),
    ("--clip-grad", dict(type=float, default=1.0, help="Global grad-norm clip (0 = off).")),
    (
        "--optimizer-cpu-offload",
        dict(
            action="store_true",
            help="Megatron backend: Adam's fp32 master weights and moments and its step on the CPU (Megatron-Core's "
            "hybrid CPU/GPU optimizer); needs --use-precision-aware-optimizer and --bf16, as in Megatron-LM.",
        ),
    ),
    (
        "--optimizer-offload-fraction",
        dict(
            type=float,
            default=1.0,
            help="With --optimizer-cpu-offload: the share of the parameters (by size) whose optimizer state and "
            "step go to the CPU; the rest stay on the GPU.",
        ),
    ),
    (
        "--overlap-cpu-optimizer-d2h-h2d",
        dict(
            action="store_true",
            help="With --optimizer-cpu-offload: one CPU optimizer per parameter, so gradient copies to the host and "
            "weight copies back overlap the CPU steps.",
        ),
    ),
    (
        "--use-precision-aware-optimizer",
        dict(
            action="store_true",
            help="With --optimizer-cpu-offload: the optimizer holds the fp32 master weights (off the GPU). On the "
            "GPU alone it is TransformerEngine's FusedAdam, which vime does not use (refused).",
        ),
    ),
    (
        "--micro-batch-size",
        dict(type=int, default=1, help="Samples per micro-batch (without dynamic batching)."),
    ),
    ("--global-batch-size", dict(type=int, default=None, help="Samples per optimizer step.")),
    (
        "--calculate-per-token-loss",
        dict(action="store_true", help="Loss = sum over tokens / tokens in the global batch."),
    ),
    ("--seed", dict(type=int, default=1234, help="Training random seed.")),
]

_PRECISION_CKPT_LOG = [
    ("--bf16", dict(action="store_true", help="Train in bf16 (default fp32).")),
    ("--fp16", dict(action="store_true", help="Train in fp16.")),
    (
        "--accumulate-allreduce-grads-in-fp32",
        dict(
            action="store_true",
            help="Accumulate and reduce gradients in fp32 (Megatron DDP's grad_reduce_in_fp32); always on with --bf16, "
            "as in Megatron-LM. The fsdp backend always reduces in fp32.",
        ),
    ),
    (
        "--attention-softmax-in-fp32",
        dict(
            action="store_true", help="fp32 softmax in attention: what vime's packed attention always does."
        ),
    ),
    ("--save", dict(default=None, help="Checkpoint directory to save to.")),
    ("--load", dict(default=None, help="Checkpoint directory to resume from.")),
    ("--save-interval", dict(type=int, default=None, help="Save every N rollouts.")),
    ("--ckpt-step", dict(type=int, default=None, help="Resume this iteration instead of the latest.")),
    (
        "--ckpt-format",
        dict(default="torch_dist", choices=["torch", "torch_dist"], help="Megatron checkpoint format."),
    ),
    ("--no-load-optim", dict(action="store_true", help="Do not load optimizer state.")),
    ("--no-load-rng", dict(action="store_true", help="Do not load RNG state.")),
    ("--no-save-optim", dict(action="store_true", help="Do not save optimizer state.")),
    ("--finetune", dict(action="store_true", help="Load weights only; reset iteration and optimizer.")),
    ("--tensorboard-dir", dict(default=None, help="TensorBoard log directory.")),
    ("--wandb-project", dict(default=None, help="W&B project.")),
    ("--wandb-exp-name", dict(default=None, help="W&B run name.")),
    ("--wandb-save-dir", dict(default=None, help="W&B local directory.")),
]


# vime's own Megatron-backend flags (Megatron-LM has none of these), added in both cases.
_VIME_MEGATRON = [
    (
        "--custom-megatron-init-path",
        dict(default=None, help="Import path of fn(args), called once the Megatron parallel groups exist."),
    ),
    (
        "--custom-megatron-before-log-prob-hook-path",
        dict(
            default=None,
            help="Import path of fn(args, model, samples, which) called before each log-prob pass "
            "(which: actor, ref or teacher).",
        ),
    ),
    (
        "--custom-megatron-before-train-step-hook-path",
        dict(
            default=None,
            help="Import path of fn(args, rollout_id, step_id, model, optimizer, scheduler) called before "
            "each optimizer step.",
        ),
    ),
    (
        "--custom-model-provider-path",
        dict(
            default=None,
            help="fn(pre_process, post_process, vp_stage=None) -> GPTModel replacing vime's model builder (slime); "
            "start from vime.backends.megatron_utils.model.build_gpt_model, whose packed attention it must keep.",
        ),
    ),
    (
        "--model-name",
        dict(
            default=None,
            help="The model family (slime picks its weight converter by it); vime maps weights by config.json's "
            "model_type and checks that this names the same family.",
        ),
    ),
    (
        "--padded-vocab-size",
        dict(
            type=int,
            default=None,
            help="Megatron's vocabulary size (default: the HF vocabulary padded to --make-vocab-size-divisible-by "
            "x TP); a multiple of TP, at least the HF vocabulary.",
        ),
    ),
    (
        "--megatron-config-path",
        dict(
            default=None,
            help="YAML of Megatron flag overrides: top-level keys for every role, 'actor:' / 'critic:' "
            "mappings for one role.",
        ),
    ),
]


def megatron_lm_available() -> bool:
    """Whether Megatron-LM's ``megatron.training`` (not only megatron-core) is importable."""
    try:
        module = importlib.import_module("megatron.training.arguments")
    except Exception:  # ImportError, or megatron.training failing to import without CUDA
        return False
    return hasattr(module, "add_megatron_arguments")


def add_megatron_arguments(parser: argparse.ArgumentParser) -> str:
    """Add the Megatron flags; returns ``"megatron-lm"`` or ``"vime"`` saying whose definitions were used.

    vime's copy is the default. The megatron-core wheel itself ships ``megatron.training``, whose full parser
    (~700 flags) clashes with vime's own flags (``--eval-interval`` ...) and has other defaults (``--lr None``),
    so Megatron-LM's definitions are used only with ``VIME_USE_MEGATRON_LM_ARGS=1``.
    """
    if os.environ.get("VIME_USE_MEGATRON_LM_ARGS") == "1" and megatron_lm_available():
        from megatron.training.arguments import add_megatron_arguments as add_upstream

        add_upstream(parser)
        # vime trains without dropout and without TransformerEngine
        parser.set_defaults(attention_dropout=0.0, hidden_dropout=0.0, transformer_impl="local")
        _add_vime_megatron_flags(parser)
        return "megatron-lm"
    sections = [
        ("megatron: model shape", _MODEL),
        ("megatron: mixture of experts", _MOE),
        ("megatron: parallelism and recompute", _PARALLEL),
        ("megatron: optimizer, schedule and batch", _OPTIM),
        ("megatron: precision, checkpoints, logging", _PRECISION_CKPT_LOG),
    ]
    for title, flags in sections:
        group = parser.add_argument_group(title)
        for flag, kwargs in flags:
            group.add_argument(flag, **kwargs)
    _add_vime_megatron_flags(parser)
    return "vime"


def _add_vime_megatron_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("megatron backend: hooks and per-role config")
    for flag, kwargs in _VIME_MEGATRON:
        if flag not in parser._option_string_actions:  # Megatron-LM's own parser may define it already
            group.add_argument(flag, **kwargs)
