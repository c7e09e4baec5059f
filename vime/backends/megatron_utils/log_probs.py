"""Log-probs and entropy from vocab-parallel logits, without gathering the full ``[tokens, vocab]`` logits.

Each tensor-parallel rank holds the logits of its vocabulary slice. Softmax statistics are combined with
all-reduces; every TP rank computes the same loss, so each rank's gradient is the gradient with respect to its own
slice (Megatron's convention). The pass keeps no fp32 ``[tokens, vocab]`` temporary for backward
(:mod:`vime.utils.chunked_log_probs`).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from vime.utils.chunked_log_probs import chunked_log_probs


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    true_vocab_size: int,
    with_entropy: bool = False,
    entropy_requires_grad: bool = False,
    chunk_size: int = -1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / T)[labels]`` and (optionally) the entropy, fp32, from this rank's logits slice
    ``[N, V / tp]``, ``chunk_size`` rows at a time forward and backward (``--log-probs-chunk-size``; every TP rank
    holds the same rows, so the chunks' collectives line up). Columns at or past ``true_vocab_size`` (Megatron's
    vocabulary padding) are excluded."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    return chunked_log_probs(
        logits,
        labels,
        temperature,
        with_entropy=with_entropy,
        entropy_requires_grad=entropy_requires_grad,
        chunk_size=chunk_size,
        vocab_start=parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1],
        true_vocab_size=true_vocab_size,
        group=parallel_state.get_tensor_model_parallel_group() if tp_size > 1 else None,
    )
