"""The loop's schedule: rollouts, epochs, batch sizes, intervals.

Each group is a list of ``(flag, add_argument kwargs)``; ``vime.utils.arguments`` builds the parser."""

from __future__ import annotations

SCHEDULE = [
    ("--num-rollout", dict(type=int, default=None, help="Rollout steps to run (default: from --num-epoch).")),
    ("--num-epoch", dict(type=int, default=None, help="Passes over --prompt-data (sets --num-rollout).")),
    (
        "--num-steps-per-rollout",
        dict(type=int, default=None, help="Optimizer steps per rollout (sets --global-batch-size)."),
    ),
    (
        "--use-dynamic-batch-size",
        dict(action="store_true", help="Pack micro-batches up to --max-tokens-per-gpu."),
    ),
    (
        "--max-tokens-per-gpu",
        dict(type=int, default=None, help="Token budget per micro-batch with dynamic batching."),
    ),
    (
        "--gradient-checkpointing",
        dict(
            action="store_true",
            help="Activation checkpointing of every layer, on either backend: the same as --recompute-granularity "
            "full --recompute-method uniform --recompute-num-layers 1.",
        ),
    ),
    (
        "--balance-data",
        dict(
            action="store_true",
            help="Balance the estimated training FLOPs (not only the tokens) of each step's data-parallel "
            "shares (slime).",
        ),
    ),
    (
        "--balance-by-flops",
        dict(
            action="store_true",
            help="Pack micro-batches by estimated FLOPs (linear + quadratic in length) instead of tokens; a "
            "micro-batch may then exceed --max-tokens-per-gpu. Needs --use-dynamic-batch-size; implies "
            "--balance-data.",
        ),
    ),
    (
        "--log-probs-max-tokens-per-gpu",
        dict(
            type=int,
            default=None,
            help="Token budget of forward-only micro-batches (old/ref/teacher log-probs, critic values) with "
            "dynamic batching (default: --max-tokens-per-gpu).",
        ),
    ),
    (
        "--log-probs-chunk-size",
        dict(
            type=int,
            default=-1,
            help="Compute log-softmax and entropy over this many tokens at a time (-1: all at once); saves the "
            "memory of full [tokens, vocab] fp32 temporaries. On CUDA (with Triton) one kernel reads the logits "
            "once and makes no such temporary, so the setting applies to CPU runs only.",
        ),
    ),
    (
        "--recompute-loss-function",
        dict(
            action="store_true",
            help="Recompute the loss from the logits in backward instead of keeping its [tokens, vocab] "
            "intermediates (less memory, one more softmax).",
        ),
    ),
    (
        "--data-pad-size-multiplier",
        dict(
            type=int,
            default=1,
            help="Megatron: pad each packed micro-batch to a multiple of this x TP (x CP) tokens, for kernels "
            "that want aligned lengths (slime defaults to 128; vime's kernels need no padding).",
        ),
    ),
    (
        "--allgather-cp",
        dict(
            action="store_true",
            help="Context parallelism that all-gathers keys and values (slime): what vime's CP always does.",
        ),
    ),
    (
        "--update-weights-interval",
        dict(type=int, default=1, help="Push weights to engines every N rollouts (train_async)."),
    ),
]
