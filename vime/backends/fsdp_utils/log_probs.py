"""Forward passes over packed micro-batches: response-token log-probs, entropy, and critic values."""

from __future__ import annotations

import torch
from torch import nn

from vime.utils.chunked_log_probs import chunked_log_probs
from vime.utils.train_data import PackedBatch
from vime.utils.varlen_attention import VarlenBlocks


def _inputs(batch: PackedBatch, device: torch.device) -> dict:
    # position_ids restart at 0 per sample (RoPE); vime_blocks keeps samples apart in the packed attention
    # (fsdp_utils.model.packed_attention). No KV cache and no attention mask.
    return {
        "input_ids": batch.input_ids.to(device, non_blocking=True).unsqueeze(0),
        "position_ids": batch.position_ids.to(device, non_blocking=True).unsqueeze(0),
        "use_cache": False,
        "vime_blocks": VarlenBlocks.for_sequences(batch.total_lengths, device),
    }


def response_logits(
    model: nn.Module, batch: PackedBatch, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, labels)`` at the positions that predict the response tokens, ``[N, V]`` and ``[N]``.

    Only those positions go through the LM head (``logits_to_keep``), so the ``[tokens, vocab]`` logits of prompts
    are never built.
    """
    index = batch.logit_indices().to(device, non_blocking=True)
    inputs = _inputs(batch, device)
    logits = model(**inputs, logits_to_keep=index).logits[0]
    return logits, inputs["input_ids"][0, index + 1]


def token_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    entropy_requires_grad: bool = False,
    chunk_size: int = -1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` (and the entropy of each predicting distribution) for ``logits / temperature``,
    1-D fp32, ``chunk_size`` rows at a time (``--log-probs-chunk-size``; -1: all at once) forward and backward
    (:func:`~vime.utils.chunked_log_probs.chunked_log_probs`: no fp32 ``[tokens, vocab]`` temporary is kept for
    backward). Grad flows to the log-probs if the caller enables it; to the entropy only with
    ``entropy_requires_grad``."""
    return chunked_log_probs(
        logits,
        labels,
        temperature,
        with_entropy=with_entropy,
        entropy_requires_grad=entropy_requires_grad,
        chunk_size=chunk_size,
    )


def forward_log_probs(
    model: nn.Module,
    batch: PackedBatch,
    temperature: float,
    device: torch.device,
    with_entropy: bool = False,
    entropy_requires_grad: bool = False,
    chunk_size: int = -1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_log_probs` of :func:`response_logits`: log-probs of the response tokens (and entropies) under
    ``model``, 1-D fp32 over the packed responses (``batch.response_lengths``)."""
    logits, labels = response_logits(model, batch, device)
    return token_log_probs(logits, labels, temperature, with_entropy, entropy_requires_grad, chunk_size)


def forward_values(model: nn.Module, batch: PackedBatch, device: torch.device) -> torch.Tensor:
    """Critic values at the positions that predict each response token (the state before the action), fp32,
    1-D over the packed responses."""
    index = batch.logit_indices().to(device, non_blocking=True)
    return model(**_inputs(batch, device)).logits[0, index, 0].float()
