"""Build Hugging Face models for training and shard them with FSDP2 (``fully_shard``).

Every rank loads the full HF checkpoint on the CPU, then ``fully_shard`` keeps and moves to the device only this
rank's shard of each parameter. Each decoder layer (the classes in ``model._no_split_modules``) is its own FSDP
unit, so only one layer's full weights are gathered at a time; the root unit holds embeddings, final norm and
head. Master weights stay fp32; ``--bf16`` computes in bf16 (FSDP2 mixed precision) and reduces grads in fp32.
Packed rows keep their samples apart: attention through vime's varlen attention, linear attention (Qwen3-Next's gated
DeltaNet) by running each sample's rows on their own (:func:`split_linear_attention`).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from vime.utils.varlen_attention import VarlenBlocks, packed_causal_attention

# Packed micro-batches: each sample attends only to itself, through vime's varlen attention (FlashAttention-2
# varlen kernels on GPU in bf16, one SDPA call per sample otherwise); transformers builds no mask for it.
ATTN_IMPLEMENTATION = "vime_packed"
ROLES = ("actor", "critic")


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function for packed rows (``query`` [1, heads, T, d], key/value [1, groups, T, d]);
    the forward call passes the row's :class:`VarlenBlocks` as ``vime_blocks``."""
    blocks = kwargs.get("vime_blocks")
    if blocks is None or query.shape[0] != 1 or dropout:
        raise ValueError(
            f"{ATTN_IMPLEMENTATION} attention takes one packed row (batch 1, no dropout) and vime_blocks=VarlenBlocks "
            "in the forward call (vime.backends.fsdp_utils.log_probs does this)"
        )
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads or groups, d]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return packed_causal_attention(q, k, v, blocks, scale).unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention)


def _per_sequence(forward: Callable) -> Callable:
    """``forward`` of a token mixer whose state runs along the row (gated DeltaNet's short convolution and
    recurrence), called once per packed sequence: transformers' paths for it would carry one sample's state into the
    next sample of the row."""

    @functools.wraps(forward)
    def run(
        hidden_states: torch.Tensor, *args, vime_blocks: VarlenBlocks | None = None, **kwargs
    ) -> torch.Tensor:
        if vime_blocks is None:  # an unpacked batch (transformers' own use)
            return forward(hidden_states, *args, **kwargs)
        parts = [forward(hidden_states[:, a:b], *args, **kwargs) for a, b, _, _ in vime_blocks.blocks]
        return torch.cat(parts, dim=1)

    return run


def split_linear_attention(model: nn.Module) -> int:
    """Make every linear-attention layer of ``model`` (Qwen3-Next's gated DeltaNet) run packed sequences one by
    one; returns how many it found."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    for layer in layers:
        layer.forward = _per_sequence(layer.forward)
    return len(layers)


def compute_dtype(args: argparse.Namespace) -> torch.dtype:
    """The forward/backward dtype: bf16 with ``--bf16``, else fp32."""
    return torch.bfloat16 if args.bf16 else torch.float32


def load_hf_model(path: str, role: str) -> nn.Module:
    """Load an HF checkpoint in fp32 on the CPU: a causal LM for the actor, a one-label token classifier (a value
    head on the same backbone, newly initialised when ``path`` is a policy) for the critic.

    Dropout is switched off: the PPO ratio of an unchanged policy must be exactly 1, and the old log-probs are
    computed without dropout.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
    config = AutoConfig.from_pretrained(path)
    for key, value in config.to_dict().items():
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    if role == "critic":
        config.num_labels = 1
        config.classifier_dropout = 0.0  # GenericForTokenClassification falls back to p=0.1 otherwise
        cls = AutoModelForTokenClassification
    else:
        cls = AutoModelForCausalLM
    model = cls.from_pretrained(
        path, config=config, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION
    )
    # Recorded before fully_shard renames the class (FSDP<Name>), so an HF export names the right architecture.
    model.config.architectures = [type(model).__name__]
    split_linear_attention(model)
    return model


def checkpointed_layers(args: argparse.Namespace, num_layers: int) -> int:
    """How many leading decoder layers keep only their input for backward, from Megatron's recompute flags:
    ``--recompute-granularity full`` with ``--recompute-method uniform --recompute-num-layers 1`` is every layer,
    with ``block N`` the first N (``--gradient-checkpointing`` is the former; validation refuses the rest)."""
    if args.recompute_granularity != "full":
        return 0
    if args.recompute_method == "block":
        return min(args.recompute_num_layers, num_layers)
    return num_layers


def enable_activation_checkpointing(
    model: nn.Module, layers: list[nn.Module], args: argparse.Namespace
) -> None:
    """Hugging Face gradient checkpointing on the first :func:`checkpointed_layers` of ``layers``."""
    if count := checkpointed_layers(args, len(layers)):
        # Non-reentrant checkpointing is the variant that composes with FSDP2's hooks.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer in layers[count:]:
            layer.gradient_checkpointing = False


def shard_model(model: nn.Module, mesh: DeviceMesh, args: argparse.Namespace) -> nn.Module:
    """Apply FSDP2: one unit per decoder layer plus the root; activation checkpointing from the recompute flags."""
    mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype(args), reduce_dtype=torch.float32)
    layer_classes = tuple(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} lists no decoder-layer classes in _no_split_modules; cannot shard it per layer"
        )
    enable_activation_checkpointing(model, layers, args)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def build_model(
    path: str, role: str, mesh: DeviceMesh, args: argparse.Namespace, trainable: bool = True
) -> nn.Module:
    """Load ``path`` for ``role`` and shard it; a frozen model (reference, teacher) has no grads and runs in
    eval mode."""
    model = shard_model(load_hf_model(path, role), mesh, args)
    model.train(trainable)
    model.requires_grad_(trainable)
    return model
