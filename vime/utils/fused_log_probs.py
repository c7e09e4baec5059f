"""Triton kernels for :mod:`vime.utils.chunked_log_probs` on GPU: each reads the ``[rows, vocab]`` logits once in
their own dtype, where the torch path makes about a dozen fp32 passes over every chunk (a 30B-A3B-shaped step spent
~0.9 s of its 3.8 s in them at Qwen3's 151,936-token vocabulary).

:func:`row_stats` keeps an online softmax per row (per lane, merged at the end): the row's maximum ``m``,
``s = sum exp(z - m)``, ``t = sum exp(z - m) * (z - m)`` and the label's ``z``, with ``z = logits / T``; the caller
merges those of the tensor-parallel ranks. :func:`logits_grad` writes ``d/d logits`` of ``g * log p(label) + h * H``
from the saved per-row log-normaliser and entropy. Under ``TRITON_INTERPRET=1`` both run on CPU tensors (tests).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU machine without Triton: the torch path only
    triton = None

BLOCK = 4096


def usable(logits: torch.Tensor) -> bool:
    """Whether the kernels take these logits: 2-D, unit column stride, on a GPU (or anywhere when interpreted)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return (
        triton is not None
        and (logits.is_cuda or interpreted)
        and logits.dim() == 2
        and logits.stride(-1) == 1
        and logits.shape[0] > 0
    )


if triton is not None:
    # A masked lane's value: finite, so that a lane that only ever saw padding merges with weight exp(PAD - max) = 0
    # instead of producing NaN from -inf - -inf.
    PAD = tl.constexpr(-1e30)

    @triton.jit
    def _row_stats_kernel(
        logits_ptr, row_stride, labels_ptr, out_ptr, n_rows, n_cols, n_valid, inv_t,
        WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * row_stride
        offsets = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], PAD, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        t = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            z = tl.load(base + cols, mask=cols < n_valid, other=PAD).to(tl.float32)
            z = tl.where(cols < n_valid, z * inv_t, PAD)
            new_m = tl.maximum(m, z)
            scale = tl.exp(m - new_m)
            e = tl.exp(z - new_m)
            if WITH_ENTROPY:
                t = scale * (t + (m - new_m) * s) + e * (z - new_m)
            s = s * scale + e
            m = new_m
        top = tl.max(m, axis=0)
        weight = tl.exp(m - top)
        tl.store(out_ptr + row, top)
        tl.store(out_ptr + n_rows + row, tl.sum(s * weight, axis=0))
        if WITH_ENTROPY:
            tl.store(out_ptr + 2 * n_rows + row, tl.sum(weight * (t + (m - top) * s), axis=0))
        label = tl.load(labels_ptr + row)
        picked = tl.load(base + tl.maximum(label, 0)).to(tl.float32) * inv_t
        tl.store(out_ptr + 3 * n_rows + row, tl.where(label >= 0, picked, 0.0))

    @triton.jit
    def _logits_grad_kernel(
        logits_ptr, row_stride, grad_ptr, labels_ptr, log_norm_ptr, entropy_ptr, grad_lp_ptr, grad_h_ptr,
        n_cols, n_valid, inv_t, HAS_LP: tl.constexpr, HAS_H: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        source = logits_ptr + row.to(tl.int64) * row_stride
        target = grad_ptr + row.to(tl.int64) * n_cols  # the gradient is contiguous
        offsets = tl.arange(0, BLOCK)
        log_norm = tl.load(log_norm_ptr + row)
        label = tl.load(labels_ptr + row)
        g = 0.0
        if HAS_LP:
            g = tl.load(grad_lp_ptr + row)
        g_h = 0.0
        centre = 0.0
        if HAS_H:
            g_h = tl.load(grad_h_ptr + row)
            centre = log_norm - tl.load(entropy_ptr + row)  # sum(p * z)
        for start in range(0, n_cols, BLOCK):
            cols = start + offsets
            valid = cols < n_valid
            z = tl.load(source + cols, mask=valid, other=0.0).to(tl.float32) * inv_t
            p = tl.exp(z - log_norm)
            coef = g + g_h * (z - centre)
            d = tl.where(cols == label, g, 0.0) - p * coef
            d = tl.where(valid, d, 0.0) * inv_t
            tl.store(target + cols, d.to(grad_ptr.dtype.element_ty), mask=cols < n_cols)


def row_stats(
    logits: torch.Tensor, local_labels: torch.Tensor, n_valid: int, temperature: float, with_entropy: bool
) -> torch.Tensor:
    """fp32 ``[4, rows]``: each row's max ``m`` of ``z = logits / T`` over its first ``n_valid`` columns,
    ``sum exp(z - m)``, ``sum exp(z - m) * (z - m)`` (0 without ``with_entropy``) and ``z[label]`` (0 where
    ``local_labels`` is -1: the label is in another rank's columns)."""
    rows, cols = logits.shape
    out = torch.zeros(4, rows, dtype=torch.float32, device=logits.device)
    _row_stats_kernel[(rows,)](
        logits, logits.stride(0), local_labels, out, rows, cols, n_valid, 1.0 / temperature,
        WITH_ENTROPY=with_entropy, BLOCK=min(BLOCK, triton.next_power_of_2(cols)), num_warps=8,
    )  # fmt: skip
    return out


def logits_grad(
    logits: torch.Tensor,
    local_labels: torch.Tensor,
    n_valid: int,
    temperature: float,
    log_norm: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_log_probs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
) -> torch.Tensor:
    """The gradient of ``sum(grad_log_probs * log p(label)) + sum(grad_entropy * H)`` with respect to ``logits``, in
    their dtype (padding columns 0)."""
    rows, cols = logits.shape
    grad = torch.empty((rows, cols), dtype=logits.dtype, device=logits.device)
    _logits_grad_kernel[(rows,)](
        logits, logits.stride(0), grad, local_labels, log_norm,
        log_norm if entropy is None else entropy,
        log_norm if grad_log_probs is None else grad_log_probs.float().contiguous(),
        log_norm if grad_entropy is None else grad_entropy.float().contiguous(),
        cols, n_valid, 1.0 / temperature, HAS_LP=grad_log_probs is not None, HAS_H=grad_entropy is not None,
        BLOCK=min(BLOCK, triton.next_power_of_2(cols)), num_warps=8,
    )  # fmt: skip
    return grad
