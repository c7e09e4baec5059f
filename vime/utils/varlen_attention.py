"""Causal attention over packed variable-length sequences, shared by both training backends.

A packed micro-batch holds many sequences in one row of ``[tokens, heads, head_dim]``. :class:`VarlenBlocks`
says which query rows attend to which key rows: block ``i``'s queries are the last rows of its key range
(causal, aligned to the end of the range, which covers both whole sequences and context-parallel chunks).

On CUDA in fp16/bf16 the whole micro-batch runs as one FlashAttention-2 varlen launch per layer (PyTorch's own
ATen flash kernels, forward and backward; grouped-query heads need no expansion). Elsewhere (CPU, fp32: the
exactness tests) the blocks of one shape run as one batched ``scaled_dot_product_attention`` call (an RL batch
holds many sequences of a few lengths: one call per block cost more in launches than in arithmetic), with no mask
materialised either way.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


@dataclass
class VarlenBlocks:
    """``blocks``: ``(q_start, q_end, k_start, k_end)`` per attention block, query rows consecutive from 0; the
    queries of a block sit at the last ``q_end - q_start`` positions of its key range. Tensors on ``device``."""

    blocks: list[tuple[int, int, int, int]]
    device: torch.device

    @classmethod
    def for_sequences(cls, lengths: list[int], device) -> VarlenBlocks:
        """Whole sequences packed back to back, each attending to itself."""
        starts = [0, *accumulate(lengths)]
        return cls([(a, b, a, b) for a, b in zip(starts[:-1], starts[1:], strict=True)], torch.device(device))

    @cached_property
    def cu_seqlens_q(self) -> torch.Tensor:
        return self._cumulative([b - a for a, b, _, _ in self.blocks])

    @cached_property
    def cu_seqlens_k(self) -> torch.Tensor:
        return self._cumulative([d - c for _, _, c, d in self.blocks])

    @property
    def max_q(self) -> int:
        return max(b - a for a, b, _, _ in self.blocks)

    @property
    def max_k(self) -> int:
        return max(d - c for _, _, c, d in self.blocks)

    @cached_property
    def key_index(self) -> torch.Tensor | None:
        """Key rows of every block back to back (for the varlen kernel), or None when they already are."""
        if all(c == (self.blocks[i - 1][3] if i else 0) for i, (_, _, c, _) in enumerate(self.blocks)):
            return None
        return torch.cat([torch.arange(c, d) for _, _, c, d in self.blocks]).to(
            self.device, non_blocking=True
        )

    def _cumulative(self, sizes: list[int]) -> torch.Tensor:
        return torch.tensor([0, *accumulate(sizes)], dtype=torch.int32).to(self.device, non_blocking=True)


def flash_varlen_supported(query: torch.Tensor) -> bool:
    """Whether :func:`packed_causal_attention` can use the FlashAttention-2 varlen kernels for ``query``."""
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[-1] % 8 == 0
        and query.shape[-1] <= 256
        and torch.cuda.get_device_capability(query.device) >= (8, 0)
    )


class _FlashVarlenCausal(torch.autograd.Function):
    """FlashAttention-2 varlen forward/backward through PyTorch's ATen ops (no extra package)."""

    @staticmethod
    def forward(ctx, query, key, value, cu_q, cu_k, max_q: int, max_k: int, scale: float):
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            query, key, value, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(query, key, value, out, lse, cu_q, cu_k, seed, offset)
        ctx.max_q, ctx.max_k, ctx.scale = max_q, max_k, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, cu_q, cu_k, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), query, key, value, out, lse, cu_q, cu_k, ctx.max_q, ctx.max_k, 0.0, True,
            seed, offset, scale=ctx.scale,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of ``query`` [..., heads, Lq, d] over ``key``/``value`` [..., groups, Lk, d] (``Lq <= Lk``),
    query ``i`` sitting at key position ``Lk - Lq + i``. Query head ``h`` uses key/value group
    ``h // (heads / groups)``. Leading dimensions, if any, are a batch."""
    q_len, k_len = query.shape[-2], key.shape[-2]
    if q_len == k_len:
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=query.shape[-3] != key.shape[-3]
        )
    # a lower-right causal bias runs in the flash / memory-efficient kernels without materialising a mask; those
    # kernels take grouped-query attention only through expanded keys and values, and want a batch dimension
    repeat = query.shape[-3] // key.shape[-3]
    unbatched = query.dim() == 3
    q, k, v = (
        x.unsqueeze(0) if unbatched else x
        for x in (query, key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3))
    )
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, k_len), scale=scale)
    return out[0] if unbatched else out


def packed_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: VarlenBlocks, scale: float
) -> torch.Tensor:
    """Causal attention of query rows [t, heads, d] over key/value rows [T, groups, d] (values: [T, groups, d_v]) block
    by block (:class:`VarlenBlocks`); returns [t, heads, d_v]."""
    head_v = value.shape[-1]
    if flash_varlen_supported(query) and head_v <= query.shape[-1]:
        index = blocks.key_index
        if index is not None:
            key, value = key.index_select(0, index), value.index_select(0, index)
        # the kernels take one head size: multi-latent attention's smaller value heads are zero-padded, which adds
        # zero output columns (cut off again) and leaves the others as they are
        value = F.pad(value, (0, query.shape[-1] - head_v))
        out = _FlashVarlenCausal.apply(
            query.contiguous(), key.contiguous(), value.contiguous(),
            blocks.cu_seqlens_q, blocks.cu_seqlens_k, blocks.max_q, blocks.max_k, scale,
        )  # fmt: skip
        return out[..., :head_v]
    q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [heads or groups, rows, d]
    by_shape: dict[tuple[int, int], list[tuple[int, int, int, int]]] = defaultdict(list)
    for block in blocks.blocks:
        by_shape[(block[1] - block[0], block[3] - block[2])].append(block)
    query_rows, outs = [], []
    for (q_len, k_len), group in by_shape.items():
        rows = _rows([(a, b) for a, b, _, _ in group], q.device)
        keys = _rows([(c, d) for _, _, c, d in group], q.device)
        # [blocks, heads or groups, length, d]: one batched call for every block of this shape
        batch_q, batch_k, batch_v = (
            x.index_select(1, index).unflatten(1, (len(group), length)).transpose(0, 1)
            for x, index, length in ((q, rows, q_len), (k, keys, k_len), (v, keys, k_len))
        )
        outs.append(causal_attention(batch_q, batch_k, batch_v, scale).transpose(0, 1).flatten(1, 2))
        query_rows.append(rows)
    out = torch.cat(outs, dim=1)
    if len(outs) > 1:  # back to the blocks' order: output row i is query row order[i]
        order = torch.cat(query_rows)
        out = out.index_select(
            1, torch.empty_like(order).index_copy_(0, order, torch.arange(len(order), device=order.device))
        )
    return out.transpose(0, 1)


def _rows(ranges: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """The row indices of ``ranges`` back to back."""
    return torch.cat([torch.arange(start, end) for start, end in ranges]).to(device, non_blocking=True)
