"""The weight gradient of a grouped (per-expert) linear layer, added straight into its fp32 ``main_grad``.

For expert ``e`` with rows ``offs[e-1]:offs[e]`` of ``x`` ``[tokens, in]`` and of ``grad_out`` ``[tokens, out]``,
``main_grad[e] += grad_out[rows].T @ x[rows]``. One Triton kernel does what took two passes in torch: ``grouped_mm``
writing a bf16 ``[E, out, in]`` gradient (torch 2.11 gives it no fp32 output), then an ``add_`` of mixed dtypes
reading it back into the fp32 buffer (0.21 s of a 2.25 s 30B-A3B step on one H200). The products accumulate in fp32
and are added in fp32, so the result is at least as exact as the two-pass one. Under ``TRITON_INTERPRET=1`` the
kernel runs on CPU tensors (tests). ``grouped_linear`` takes it on GPU; ``bench/grouped_wgrad.py`` measures it
against the two passes.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU machine without Triton: callers keep the torch path
    triton = None


def usable(grad_out: torch.Tensor, x: torch.Tensor, main_grad: torch.Tensor) -> bool:
    """Whether :func:`add_weight_grads` takes these tensors: Triton there, on a GPU (or interpreted), 2-D row-major
    inputs of one dtype, and a contiguous fp32 ``[E, out, in]`` buffer."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return (
        triton is not None
        and (x.is_cuda or interpreted)
        and x.dim() == grad_out.dim() == 2
        and x.stride(1) == grad_out.stride(1) == 1
        and x.dtype == grad_out.dtype
        and main_grad.dtype == torch.float32
        and main_grad.dim() == 3
        and main_grad.is_contiguous()
    )


if triton is not None:

    @triton.jit
    def _add_weight_grads_kernel(
        grad_out_ptr, x_ptr, offs_ptr, main_grad_ptr, n_out, n_in, grad_out_stride, x_stride,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        # programs of one expert are adjacent (axis 0 is the tile), so its rows stay in L2 while its tiles run
        tile, expert = tl.program_id(0), tl.program_id(1)
        start = tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0)
        end = tl.load(offs_ptr + expert)
        if end > start:
            tiles_n = tl.cdiv(n_in, BLOCK_N)
            rows_out = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
            cols_in = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(start, end, BLOCK_K):
                tokens = (k + tl.arange(0, BLOCK_K)).to(tl.int64)
                in_rows = tokens < end
                g = tl.load(  # [BLOCK_M, BLOCK_K]: grad_out's rows, transposed
                    grad_out_ptr + tokens[None, :] * grad_out_stride + rows_out[:, None],
                    mask=in_rows[None, :] & (rows_out[:, None] < n_out),
                    other=0.0,
                )
                a = tl.load(  # [BLOCK_K, BLOCK_N]
                    x_ptr + tokens[:, None] * x_stride + cols_in[None, :],
                    mask=in_rows[:, None] & (cols_in[None, :] < n_in),
                    other=0.0,
                )
                acc += tl.dot(g, a, input_precision=INPUT_PRECISION)
            base = expert.to(tl.int64) * n_out * n_in  # past 2**31 elements at DeepSeek-V3's expert sizes
            target = main_grad_ptr + base + rows_out[:, None] * n_in + cols_in[None, :]
            inside = (rows_out[:, None] < n_out) & (cols_in[None, :] < n_in)
            tl.store(target, tl.load(target, mask=inside, other=0.0) + acc, mask=inside)


def add_weight_grads(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    offs: torch.Tensor,
    main_grad: torch.Tensor,
    block_m: int = 64,
    block_n: int = 128,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 4,
) -> None:
    """``main_grad[e] += grad_out[rows_e].T @ x[rows_e]`` for every expert ``e`` (``offs``: int32 cumulative row
    counts on the tensors' device, as ``grouped_mm`` takes them; an expert may have no rows). The block sizes and
    launch settings are there for ``bench/grouped_wgrad.py``; the defaults were its fastest at the 30B-A3B layer on an
    H200 (2.70 ms against 2.85 for 128 x 128 x 64 with 8 warps and 3 stages, and 3.39 for torch's two passes)."""
    experts, n_out, n_in = main_grad.shape
    if grad_out.shape[1] != n_out or x.shape[1] != n_in or len(offs) != experts:
        raise ValueError(
            f"grad_out {tuple(grad_out.shape)}, x {tuple(x.shape)} and offs ({len(offs)}) do not fit main_grad "
            f"{tuple(main_grad.shape)}"
        )
    tiles = triton.cdiv(n_out, block_m) * triton.cdiv(n_in, block_n)
    # fp32 operands multiply in full fp32, as torch's matmul does by default (Triton's default on a GPU is TF32:
    # 1e-2 off on the H200); bf16 products are exact in fp32 whatever the setting
    input_precision = "ieee" if grad_out.dtype == torch.float32 else None
    _add_weight_grads_kernel[(tiles, experts)](
        grad_out, x, offs, main_grad, n_out, n_in, grad_out.stride(0), x.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, INPUT_PRECISION=input_precision,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
