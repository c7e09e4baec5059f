"""Forward passes over packed micro-batches: response-token log-probs, entropy, and critic values."""

from __future__ import annotations

import torch
from torch import nn

from vime.utils.ppo_utils import entropy_from_logits, log_probs_from_logits
from vime.utils.train_data import PackedBatch
from vime.utils.varlen_attention import VarlenBlocks


def _inputs(batch: PackedBatch, device: torch.device) -> dict:
    # position_ids restart at 0 per sample (RoPE); vime_blocks keeps samples apart in the packed attention
    # (fsdp_utils.model.packed_attention). No KV cache and no attention mask.
    return {
        "input_ids": batch.input_ids.to(device).unsqueeze(0),
        "position_ids": batch.position_ids.to(device).unsqueeze(0),
        "use_cache": False,
        "vime_blocks": VarlenBlocks.for_sequences(batch.total_lengths, device),
    }


def forward_log_probs(
    model: nn.Module,
    batch: PackedBatch,
    temperature: float,
    device: torch.device,
    with_entropy: bool = False,
    entropy_requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens (and the entropy of each predicting distribution) under ``model``, for
    logits divided by ``temperature``; 1-D fp32 tensors over the packed responses (``batch.response_lengths``).

    Only the positions that predict response tokens go through the LM head (``logits_to_keep``), so the
    ``[tokens, vocab]`` logits of prompts are never built. Grad flows to the log-probs if the caller enables it;
    to the entropy only with ``entropy_requires_grad`` (its softmax would otherwise be kept for backward).
    """
    index = batch.logit_indices().to(device)
    logits = model(**_inputs(batch, device), logits_to_keep=index).logits[0]
    labels = batch.input_ids.to(device)[index + 1]
    log_probs = log_probs_from_logits(logits, labels, temperature)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_requires_grad):
            entropy = entropy_from_logits(logits, temperature)
    return log_probs, entropy


def forward_values(model: nn.Module, batch: PackedBatch, device: torch.device) -> torch.Tensor:
    """Critic values at the positions that predict each response token (the state before the action), fp32,
    1-D over the packed responses."""
    index = batch.logit_indices().to(device)
    return model(**_inputs(batch, device)).logits[0, index, 0].float()
