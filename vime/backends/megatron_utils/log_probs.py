"""Log-probs and entropy from vocab-parallel logits, without gathering the full ``[tokens, vocab]`` logits.

Each tensor-parallel rank holds the logits of its vocabulary slice. Softmax statistics are combined with
all-reduces (max, then sum of exponentials) whose backward is the identity: every TP rank computes the same
loss, so each rank's gradient is the gradient with respect to its own slice (Megatron's convention).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


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
    ``[N, V / tp]``, ``chunk_size`` rows at a time (``--log-probs-chunk-size``; every TP rank holds the same rows,
    so the chunks' collectives line up). Columns at or past ``true_vocab_size`` (Megatron's vocabulary padding)
    are excluded."""
    if 0 < chunk_size < logits.shape[0]:
        parts = [
            _vocab_parallel_log_probs(z, y, temperature, true_vocab_size, with_entropy, entropy_requires_grad)
            for z, y in zip(logits.split(chunk_size), labels.split(chunk_size), strict=True)
        ]
        entropy = torch.cat([e for _, e in parts]) if with_entropy else None
        return torch.cat([lp for lp, _ in parts]), entropy
    return _vocab_parallel_log_probs(
        logits, labels, temperature, true_vocab_size, with_entropy, entropy_requires_grad
    )


def _vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    true_vocab_size: int,
    with_entropy: bool,
    entropy_requires_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} (--rollout-temperature) must be > 0")
    group = parallel_state.get_tensor_model_parallel_group()
    rank, part = parallel_state.get_tensor_model_parallel_rank(), logits.shape[-1]
    start = rank * part
    z = logits.float() / temperature
    valid = torch.arange(start, start + part, device=z.device) < true_vocab_size
    if not bool(valid.all()):
        z = z.masked_fill(~valid, float("-inf"))
    with torch.no_grad():
        top = z.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = z - top.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1), group=group)
    log_norm = sum_exp.log()  # logsumexp(z) - top
    local = labels - start
    in_slice = (local >= 0) & (local < part)
    picked = shifted.gather(-1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1)
    # where, not a product: a label outside this slice may gather a padded column (-inf), and -inf * 0 is nan
    picked = torch.where(in_slice, picked, torch.zeros_like(picked))
    picked = reduce_from_tensor_model_parallel_region(picked, group=group)
    log_probs = picked - log_norm
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_requires_grad):
            # H = logsumexp(z) - sum(p * z) = log_norm - sum(exp * shifted) / sum_exp   (shift-invariant)
            weighted = (exp * shifted.masked_fill(exp == 0, 0.0)).sum(dim=-1)
            weighted = reduce_from_tensor_model_parallel_region(weighted, group=group)
            entropy = log_norm - weighted / sum_exp
    return log_probs, entropy
