"""One projection of all local experts as one grouped GEMM, forward and backward (no Megatron import).

``torch.stack`` of the per-expert weights under autograd splits the stacked weight gradient into one view per
expert: one ``AccumulateGrad`` and, under Megatron's DDP, one ``main_grad.add_`` per expert and micro-batch (128
experts: tens of thousands of small kernels a step). :func:`grouped_linear` instead computes the weight gradients
of all experts in one grouped GEMM and, where the weights carry Megatron DDP's ``main_grad``, adds them into the
``main_grad``s in a few ``_foreach_add_`` launches and hands autograd dummy gradients that DDP's backward hook
skips (``grad_added_to_main_grad``), as Megatron's own gradient-accumulation fusion does. Plain weights (no
``main_grad``) get ordinary gradients.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_linear(x: torch.Tensor, weights: list[torch.Tensor], offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of ``x`` ``[tokens, in]`` times ``weights[e].T`` (each ``[out, in]``), for every
    expert ``e``: ``[tokens, out]``. ``offs`` are the int32 cumulative token counts (an expert may have none)."""
    return _GroupedLinear.apply(x, offs, *weights)


class _GroupedLinear(torch.autograd.Function):
    """:func:`grouped_linear`; the backward re-stacks the weights rather than keeping the stack of the forward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offs: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, offs, *weights)
        return grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, offs, *weights = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grouped_mm(grad_out, torch.stack(weights), offs=offs) if ctx.needs_input_grad[0] else None
        grad_weights = [None] * len(weights)
        if any(ctx.needs_input_grad[2:]):
            grad_weights = _weight_grads(grad_out, x, offs, weights)
        return grad_x, None, *grad_weights


def _weight_grads(
    grad_out: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, weights: list[torch.Tensor]
) -> list[torch.Tensor | None]:
    """Every expert's weight gradient ``grad_out[rows].T @ x[rows]`` from one grouped GEMM (``[E, out, in]``;
    zero for an expert without tokens): returned as is for plain weights, else accumulated into ``main_grad``."""
    main_grads = [getattr(w, "main_grad", None) for w in weights]
    if any(g is None for g in main_grads):
        return list(grouped_mm(grad_out.t(), x, offs=offs).unbind(0))
    dtype = main_grads[0].dtype
    if _accumulates_in(x.device.type, x.dtype, dtype):
        stacked = grouped_mm(grad_out.t(), x, offs=offs, out_dtype=dtype)
    else:
        stacked = grouped_mm(grad_out.t(), x, offs=offs).to(dtype)
    torch._foreach_add_(main_grads, list(stacked.unbind(0)))
    del stacked
    return _dummy_grads(weights)


def _dummy_grads(weights: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """What autograd hands Megatron DDP's backward hook once the gradient is in ``main_grad`` (Megatron's
    convention): ``None`` for a weight DDP does not manage, else a dummy (zeros where DDP adds it anyway:
    ``zero_out_wgrad``) and ``grad_added_to_main_grad`` set so the hook skips the add. The dummies are views of one
    buffer, each its own tensor, so ``AccumulateGrad`` takes them without a copy."""
    if not all(hasattr(w, "grad_added_to_main_grad") for w in weights):
        return [None] * len(weights)
    make = torch.zeros if any(getattr(w, "zero_out_wgrad", False) for w in weights) else torch.empty
    dummies = make((len(weights), *weights[0].shape), dtype=weights[0].dtype, device=weights[0].device)
    for w in weights:
        w.grad_added_to_main_grad = True
    return list(dummies.unbind(0))


@cache
def _accumulates_in(device_type: str, dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether this torch's ``grouped_mm`` on ``device_type`` writes ``dtype`` products as ``out_dtype`` (CPU and
    older CUDA builds return the input dtype only)."""
    a = torch.zeros(16, 8, dtype=dtype, device=device_type)
    b = torch.zeros(8, 16, dtype=dtype, device=device_type)
    try:
        grouped_mm(a, b, offs=torch.tensor([8], dtype=torch.int32, device=device_type), out_dtype=out_dtype)
    except RuntimeError:
        return False
    return True
