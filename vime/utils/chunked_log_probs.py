"""Log-probs and entropy of ``[tokens, vocab]`` logits whose memory stays that of the logits themselves, forward and
backward, for both trainers (FSDP: the whole vocabulary; Megatron: this tensor-parallel rank's slice of it).

Autograd through ``log_softmax`` keeps fp32 ``[tokens, vocab]`` temporaries for backward (5 GB for 8k tokens of
Qwen3's 151,936-token vocabulary, each), and computing it ``chunk_size`` rows at a time does not help: every chunk's
temporaries stay until backward. Here the forward keeps only each row's log-normaliser (and entropy), and the backward
recomputes the softmax one chunk at a time and writes the logits' gradient in their own dtype:
``d log p(y) / d z = onehot(y) - p``, ``d H / d z = -p * (z - (lse - H))``, both over the temperature ``T``.

With a tensor-parallel ``group`` the softmax statistics are all-reduced in the forward; the backward needs no
collective (every rank holds the same per-row statistics and upstream gradients, and writes its own slice's), which is
Megatron's convention for vocabulary-parallel losses.

On GPU the forward and the backward are each one Triton kernel over all rows (:mod:`vime.utils.fused_log_probs`,
which reads the logits once and keeps no fp32 temporary, so ``chunk_size`` does not apply there); elsewhere, the torch
chunks below.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vime.utils import fused_log_probs


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _slices(rows: int, chunk_size: int) -> list[slice]:
    step = rows if chunk_size < 1 else chunk_size
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)] or [slice(0, 0)]


class _Columns:
    """This rank's vocabulary columns ``[vocab_start, vocab_start + part)``: which are padding, and where each
    label falls among them."""

    def __init__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, true_vocab_size: int):
        part = logits.shape[-1]
        columns = torch.arange(vocab_start, vocab_start + part, device=logits.device)
        self.valid = columns < true_vocab_size if true_vocab_size < vocab_start + part else None
        self.valid_count = max(0, min(part, true_vocab_size - vocab_start))
        local = labels - vocab_start
        self.in_slice = (local >= 0) & (local < part)
        self.index = local.clamp(0, part - 1).unsqueeze(-1)

    def local_labels(self) -> torch.Tensor:
        """Each label's column in this slice, -1 where it is another rank's."""
        return torch.where(self.in_slice, self.index.squeeze(-1), -1).contiguous()

    def scaled(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """A fresh fp32 ``logits / T`` (padding columns -inf), which the caller may overwrite."""
        z = logits.to(torch.float32, copy=True)
        if temperature != 1.0:  # a pass over [rows, vocab] fp32 saved where sampling used no temperature
            z.div_(temperature)
        return z if self.valid is None else z.masked_fill_(~self.valid, float("-inf"))


# One chunk's work is a function of its own so that its fp32 [chunk, V] temporaries (two, and a bool mask with the
# entropy) are freed when it returns: in a loop body they would stay bound until the next chunk's were allocated,
# doubling the peak (seen on an H200: 4.25 fp32 chunks in the backward with the entropy instead of 2.25).
def _forward_chunk(logits, cols: _Columns, rows: slice, temperature: float, group, with_entropy: bool):
    """The row maxima and the all-reduced ``[sum exp, picked logit, sum exp * shifted]`` of one chunk of rows."""
    shifted = cols.scaled(logits, temperature)
    top = _all_reduce(shifted.max(dim=-1).values, dist.ReduceOp.MAX, group)
    shifted.sub_(top.unsqueeze(-1))
    exp = shifted.exp()
    picked = shifted.gather(-1, cols.index[rows]).squeeze(-1)
    stats = [exp.sum(dim=-1), torch.where(cols.in_slice[rows], picked, 0.0)]
    if with_entropy:  # sum(exp * shifted) / sum(exp) = sum(p * z) - top; 0 * -inf counts 0
        stats.append(exp.mul_(shifted.masked_fill_(exp == 0, 0.0)).sum(dim=-1))
    return top, _all_reduce(torch.stack(stats), dist.ReduceOp.SUM, group)


def _backward_chunk(
    logits, cols: _Columns, rows: slice, temperature, log_norm, entropy, grad_log_probs, grad_entropy
):
    """The fp32 gradient of one chunk's logits (in place of one of its temporaries)."""
    z = cols.scaled(logits, temperature)
    p = (z - log_norm[rows].unsqueeze(-1)).exp_()
    # d/dz = onehot(label) * g_lp - p * (g_lp + g_H * (z - sum(p * z))), with sum(p * z) = lse - H
    g = torch.zeros_like(log_norm[rows]) if grad_log_probs is None else grad_log_probs[rows].float()
    if grad_entropy is None:
        coef = g.unsqueeze(-1)
    else:
        coef = z.sub_((log_norm[rows] - entropy[rows]).unsqueeze(-1)).masked_fill_(p == 0, 0.0)
        coef.mul_(grad_entropy[rows].float().unsqueeze(-1)).add_(g.unsqueeze(-1))
    d = p.mul_(coef).neg_()
    d.scatter_add_(-1, cols.index[rows], torch.where(cols.in_slice[rows], g, 0.0).unsqueeze(-1))
    return d if temperature == 1.0 else d.div_(temperature)


def _chunked_forward(logits, cols: _Columns, temperature: float, group, with_entropy: bool, chunk_size: int):
    """``log_norm``, log-probs and entropy, ``chunk_size`` rows at a time (the torch path)."""
    log_norm = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    log_probs, entropy = torch.empty_like(log_norm), torch.empty_like(log_norm)
    for rows in _slices(logits.shape[0], chunk_size):
        top, stats = _forward_chunk(logits[rows], cols, rows, temperature, group, with_entropy)
        log_sum = stats[0].log()
        log_norm[rows] = top + log_sum
        log_probs[rows] = stats[1] - log_sum
        if with_entropy:
            entropy[rows] = log_sum - stats[2] / stats[0]
    return log_norm, log_probs, entropy


def _fused_forward(logits, cols: _Columns, temperature: float, group, with_entropy: bool):
    """``log_norm``, log-probs and entropy from the kernel's per-row ``[max, sum exp, sum exp * shifted, picked]``
    of this rank's columns, merged over the tensor-parallel ranks around the largest maximum."""
    top, sum_exp, sum_exp_shifted, picked = fused_log_probs.row_stats(
        logits, cols.local_labels(), cols.valid_count, temperature, with_entropy
    )
    if group is not None:
        local_top = top.clone()
        _all_reduce(top, dist.ReduceOp.MAX, group)
        weight = (local_top - top).exp()
        # sum exp(z - top) * (z - top) = weight * (t + (local_top - top) * s); 0 where a rank has only padding
        sum_exp_shifted = weight * (sum_exp_shifted + (local_top - top) * sum_exp)
        stats = _all_reduce(
            torch.stack([sum_exp * weight, sum_exp_shifted, picked]), dist.ReduceOp.SUM, group
        )
        sum_exp, sum_exp_shifted, picked = stats
    log_sum = sum_exp.log()
    log_norm = top + log_sum
    return log_norm, picked - log_norm, log_sum - sum_exp_shifted / sum_exp


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits, labels, temperature, chunk_size, vocab_start, true_vocab_size, group, with_entropy
    ):
        cols = _Columns(logits, labels, vocab_start, true_vocab_size)
        if fused_log_probs.usable(logits):
            log_norm, log_probs, entropy = _fused_forward(logits, cols, temperature, group, with_entropy)
        else:
            log_norm, log_probs, entropy = _chunked_forward(
                logits, cols, temperature, group, with_entropy, chunk_size
            )
        ctx.save_for_backward(logits, labels, log_norm, entropy if with_entropy else None)
        ctx.settings = (temperature, chunk_size, vocab_start, true_vocab_size)
        ctx.set_materialize_grads(False)
        return log_probs, entropy if with_entropy else None

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, labels, log_norm, entropy = ctx.saved_tensors
        temperature, chunk_size, vocab_start, true_vocab_size = ctx.settings
        cols = _Columns(logits, labels, vocab_start, true_vocab_size)
        if fused_log_probs.usable(logits):
            grad = fused_log_probs.logits_grad(
                logits, cols.local_labels(), cols.valid_count, temperature, log_norm, entropy, grad_log_probs,
                grad_entropy,
            )  # fmt: skip
        else:
            grad = torch.empty_like(logits)
            for rows in _slices(logits.shape[0], chunk_size):
                grad[rows] = _backward_chunk(
                    logits[rows], cols, rows, temperature, log_norm, entropy, grad_log_probs, grad_entropy
                )
        return grad, None, None, None, None, None, None, None


def chunked_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    entropy_requires_grad: bool = False,
    chunk_size: int = -1,
    vocab_start: int = 0,
    true_vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / T)[labels]`` and (optionally) the entropy of each row, fp32 ``[N]``, from ``logits``
    ``[N, V]`` (or, with a tensor-parallel ``group``, this rank's columns ``vocab_start ...``), ``chunk_size`` rows at
    a time (-1: all at once) in the forward and in the backward; columns at or past ``true_vocab_size`` (vocabulary
    padding) are excluded. Gradients flow to ``logits`` from the log-probs, and from the entropy only with
    ``entropy_requires_grad``. The only ``[N, V]`` tensor kept for backward is ``logits`` itself."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} (--rollout-temperature) must be > 0")
    true_vocab_size = true_vocab_size or vocab_start + logits.shape[-1]
    log_probs, entropy = _ChunkedLogProbs.apply(
        logits, labels, temperature, chunk_size, vocab_start, true_vocab_size, group, with_entropy
    )
    if entropy is not None and not entropy_requires_grad:
        entropy = entropy.detach()
    return log_probs, entropy
