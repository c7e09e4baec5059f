"""slime flags that vime refuses: passing one stops the parse with the flag, why vime has no such setting, and
what to use instead (a flag vime does not know at all fails too, by name; none is silently ignored)."""

from __future__ import annotations

import argparse

_DELTA_SYNC = (
    "configures slime's delta weight sync, whose other half is SGLang's /pull_weights patch on the engines; vime's "
    "engines always load full weights (--update-weight-mode full): drop it"
)
_DEEPGEMM = (
    "swaps TransformerEngine linears for SGLang-compatible block-FP8 DeepGEMM kernels; vime's Megatron backend "
    "runs without TransformerEngine or FP8: drop it"
)
_MTP = "vime does not train multi-token-prediction layers (--mtp-num-layers > 0 is refused too): drop it"
_ROLLOUT_BUFFER = (
    "configures the external rollout-buffer server of slime_plugins, which vime does not ship; instead, point your own "
    "--rollout-function-path at your buffer and give it its settings with --custom-config-path"
)

# flag -> the reason and what to do instead
REFUSED_SLIME_FLAGS: dict[str, str] = {
    "--qwen-gdn-backend": "picks slime's Gated-DeltaNet kernels for Qwen3-Next/3.5 linear-attention layers, which "
    "vime's trainers do not build (Qwen3 dense/MoE, Llama 3, GLM-4.5): drop it",
    "--release-train": "destroys and recreates slime's Megatron actors around every rollout; vime keeps them and "
    "frees their GPU memory with --offload-train instead",
    "--update-weight-delta-encoding": _DELTA_SYNC,
    "--update-weight-delta-checksum": _DELTA_SYNC,
    "--update-weight-local-checkpoint-dir": "is the engine-local checkpoint that SGLang's /pull_weights patch keeps "
    "in sync; vime's engines read --update-weight-dir (disk) or receive a broadcast: drop it",
    "--multimodal-keys": "vime's rollout and trainers are text-only (no image or video inputs yet): drop it",
    "--megatron-deepgemm-forward-layers": _DEEPGEMM,
    "--megatron-deepgemm-forward-modules": _DEEPGEMM,
    "--megatron-deepgemm-moe-forward-layers": _DEEPGEMM,
    "--megatron-deepgemm-moe-forward-modules": _DEEPGEMM,
    "--enable-mtp-training": _MTP,
    "--mtp-loss-scaling-factor": _MTP,
    "--freeze-indexer": "freezes the DSA indexer of DeepSeek-V3.2 / GLM-5 models, which vime does not build; to "
    "freeze parameters by name use --freeze-params-name-list",
    "--loss-mask-type": "picks one of slime's hand-written per-family SFT loss-mask generators; vime derives the "
    "mask from the tokenizer's own chat template (vime.utils.conversation) for every model: drop it",
    "--rollout-buffer-url": _ROLLOUT_BUFFER,
    "--fetch-trajectory-retry-times": _ROLLOUT_BUFFER,
    "--min-batch-collection-ratio": _ROLLOUT_BUFFER,
    "--rollout-task-type": _ROLLOUT_BUFFER,
    "--use-distributed-post": "spreads slime's HTTP posts over Ray actors on every node; vime posts from the "
    "rollout's event loop, bounded by --rollout-concurrency: drop it",
    "--async-save": "is Megatron-LM's asynchronous checkpoint writer; vime writes checkpoints synchronously: drop it",
    "--http-proxy": "is defined but never read by slime; vime's HTTP calls stay inside the cluster and never use a "
    "proxy: drop it",
}


class RefusedFlagAction(argparse.Action):
    """A slime flag vime refuses: using it (with or without values) is a parse error giving the reason."""

    def __init__(self, option_strings, dest, reason: str, **kwargs):
        super().__init__(
            option_strings,
            dest,
            nargs="*",
            default=argparse.SUPPRESS,
            help=f"refused: {reason}",
            metavar="ANY",
        )
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        raise argparse.ArgumentError(self, f"vime refuses this slime flag: it {self.reason}")


def add_refused_flags(parser: argparse.ArgumentParser) -> None:
    """The group of slime flags vime refuses (those another definition already claims are left to it)."""
    group = parser.add_argument_group("slime flags vime refuses (each says why)")
    for flag, reason in REFUSED_SLIME_FLAGS.items():
        if flag not in parser._option_string_actions:
            group.add_argument(flag, action=RefusedFlagAction, reason=reason)
