"""One projection of all local experts as one grouped GEMM, forward and backward (no Megatron import).

The experts' weights are one stacked tensor ``[E, out, in]`` (expert ``e``'s ``[out, in]`` as ``F.linear`` takes it),
so the forward and the input gradient read it as it is, and the weight gradient of every expert comes out of one
grouped GEMM in the same layout. Where the weight carries Megatron DDP's ``main_grad`` (one contiguous view of the
grad buffer) the gradient is added into it (on GPU by :mod:`vime.utils.grouped_wgrad`'s kernel, which accumulates in
fp32 and adds in place; elsewhere a bf16 ``grouped_mm`` and one ``add_``) and autograd gets a dummy gradient that
DDP's backward hook skips (``grad_added_to_main_grad``), as Megatron's own gradient-accumulation fusion does. A
plain weight (no ``main_grad``) gets its ordinary gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vime.utils import grouped_wgrad

grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of ``x`` ``[tokens, in]`` times ``weight[e].T`` (``weight``: ``[E, out, in]``),
    for every expert ``e``: ``[tokens, out]``. ``offs`` are the int32 cumulative token counts (an expert may have
    none)."""
    return _GroupedLinear.apply(x, weight, offs)


class _GroupedLinear(torch.autograd.Function):
    """:func:`grouped_linear`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offs)
        return grouped_mm(x, weight.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, offs = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grouped_mm(grad_out, weight, offs=offs) if ctx.needs_input_grad[0] else None
        grad_weight = _weight_grad(grad_out, x, weight, offs) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight, None


def _weight_grad(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor | None:
    """Every expert's ``grad_out[rows].T @ x[rows]`` from one grouped GEMM (``[E, out, in]``; zero for an expert
    without tokens): returned for a plain weight, else added into ``main_grad`` and autograd handed what Megatron's
    DDP hook expects: ``None`` for a weight DDP does not manage, else a dummy (zeros where DDP adds it anyway:
    ``zero_out_wgrad``) with ``grad_added_to_main_grad`` set so the hook skips the add."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return grouped_mm(grad_out.t(), x, offs=offs)
    if grouped_wgrad.usable(grad_out, x, main_grad):
        grouped_wgrad.add_weight_grads(grad_out, x, offs, main_grad)  # one kernel, accumulated in fp32
    else:
        main_grad.add_(grouped_mm(grad_out.t(), x, offs=offs))  # bf16, then added into fp32
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(weight.shape, dtype=weight.dtype, device=weight.device)
