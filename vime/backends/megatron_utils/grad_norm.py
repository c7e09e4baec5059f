"""The gradient norm of Megatron-Core's optimizer without TransformerEngine or APEX, on torch's multi-tensor norm.

Megatron-Core picks its multi-tensor l2 norm when it is imported: TransformerEngine's or APEX's kernel, else
``local_multi_tensor_l2_norm``, a Python loop of one norm per gradient whose results it reads back one by one (one
host wait per parameter: 1,056 per step for the 30B-A3B shape at 4 layers). :func:`use_foreach_grad_norm` swaps
that fallback for :func:`foreach_l2_norm`, the same norm from ``torch.nn.utils.get_total_norm`` (a few kernels,
no host wait); Megatron-Core's kernels are left alone where they are installed.
"""

from __future__ import annotations

import torch


def foreach_l2_norm(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], per_tensor: bool, *args
) -> tuple[torch.Tensor, None]:
    """Megatron-Core's ``multi_tensor_l2norm`` signature: the l2 norm over every tensor of ``tensor_lists[0]``, as
    a 1-element fp32 tensor on their device (no per-tensor norms)."""
    if per_tensor:
        raise NotImplementedError("per-tensor norms (Megatron-Core asks for them only with APEX/TE kernels)")
    total = torch.nn.utils.get_total_norm(tensor_lists[0], norm_type=2.0)  # multi-tensor on a GPU
    return total.float().reshape(1), None


def use_foreach_grad_norm() -> bool:
    """Give Megatron-Core's gradient clipping :func:`foreach_l2_norm` where it would loop; whether it did."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    if clip_grads.l2_norm_impl is not local_multi_tensor_l2_norm:
        return False
    clip_grads.l2_norm_impl = foreach_l2_norm
    return True
