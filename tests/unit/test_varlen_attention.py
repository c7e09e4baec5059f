"""Packed causal attention (vime.utils.varlen_attention): whole sequences and context-parallel chunks equal
per-sequence attention written out by hand; on a CUDA GPU the FlashAttention varlen path (bf16) matches it too,
forward and backward."""

from __future__ import annotations

import math

import pytest
import torch

from vime.backends.megatron_utils.packed_layout import PackedLayout
from vime.utils.varlen_attention import (
    VarlenBlocks,
    causal_attention,
    flash_varlen_supported,
    packed_causal_attention,
)

LENGTHS = [5, 12, 1, 9, 3]
# an RL batch: a few lengths, each many times (the blocks of one shape run as one batched call)
REPEATED_LENGTHS = [5, 3, 5, 1, 3, 5, 12, 3]


def reference_attention(q, k, v, lengths, scale):
    """Per-sequence causal softmax attention written out with an explicit mask; q [T, heads, d], k/v [T, g, d]."""
    heads, groups = q.shape[1], k.shape[1]
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = q[start : start + n], k[start : start + n], v[start : start + n]
        ks, vs = (x.repeat_interleave(heads // groups, dim=1) for x in (ks, vs))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        scores = scores.masked_fill(
            ~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf")
        )
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
        start += n
    return torch.cat(outs)


def _qkv(total, heads=4, groups=2, dim=16, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(total, heads, dim, dtype=dtype, device=device, generator=g)
    k, v = (torch.randn(total, groups, dim, dtype=dtype, device=device, generator=g) for _ in range(2))
    return q, k, v


def test_blocks_of_whole_sequences():
    blocks = VarlenBlocks.for_sequences(LENGTHS, "cpu")
    assert blocks.cu_seqlens_q.tolist() == blocks.cu_seqlens_k.tolist() == [0, 5, 17, 18, 27, 30]
    assert blocks.cu_seqlens_q.dtype == torch.int32
    assert (blocks.max_q, blocks.max_k) == (12, 12)
    assert blocks.key_index is None  # the key rows already lie back to back


def test_blocks_with_overlapping_key_ranges_gather_their_keys():
    # two query chunks of one sequence (CP): rows 0-1 see keys 0-1, rows 2-3 see keys 0-5
    blocks = VarlenBlocks([(0, 2, 0, 2), (2, 4, 0, 6)], torch.device("cpu"))
    assert blocks.cu_seqlens_q.tolist() == [0, 2, 4]
    assert blocks.cu_seqlens_k.tolist() == [0, 2, 8]
    assert blocks.key_index.tolist() == [0, 1, 0, 1, 2, 3, 4, 5]
    assert (blocks.max_q, blocks.max_k) == (2, 6)


@pytest.mark.parametrize("lengths", [LENGTHS, REPEATED_LENGTHS])
def test_packed_sequences_match_per_sequence_attention_forward_and_backward(lengths):
    q, k, v = (x.requires_grad_() for x in _qkv(sum(lengths)))
    out = packed_causal_attention(q, k, v, VarlenBlocks.for_sequences(lengths, "cpu"), 0.25)
    expected = reference_attention(q, k, v, lengths, 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    for got, want in zip(
        torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("lengths", [LENGTHS, REPEATED_LENGTHS])
@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_context_parallel_attention_matches_unsplit_attention(cp_size, lengths):
    scale = 16**-0.5
    base = PackedLayout.for_parallelism(lengths, 1, False, cp_size, 0, "cpu")
    q, k, v = _qkv(base.cu_seqlens[-1])
    reference = reference_attention(q, k, v, base.padded_lengths, scale)
    for rank in range(cp_size):
        layout = PackedLayout.for_parallelism(lengths, 1, False, cp_size, rank, "cpu")
        # what the all-gather of every rank's local keys/values, re-indexed, gives each rank
        everyone = torch.cat(
            [PackedLayout(lengths, cp_size, r, layout.multiple).positions(r) for r in range(cp_size)]
        )
        k_all, v_all = (x[everyone].index_select(0, layout.gathered_index) for x in (k, v))
        out = packed_causal_attention(q[layout.local_positions], k_all, v_all, layout.attention_blocks, scale)
        torch.testing.assert_close(out, reference[layout.local_positions], rtol=1e-10, atol=1e-10)


def test_causal_attention_aligns_queries_to_the_last_keys():
    torch.manual_seed(1)
    q = torch.randn(4, 3, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 7, 8, dtype=torch.float64) for _ in range(2))
    out = causal_attention(q, k, v, scale=1 / math.sqrt(8))
    for i in range(3):  # query i sits at key position 4 + i
        keys = k.repeat_interleave(2, 0)[:, : 5 + i]
        weights = (torch.einsum("hd,hkd->hk", q[:, i], keys) / math.sqrt(8)).softmax(-1)
        expected = torch.einsum("hk,hkd->hd", weights, v.repeat_interleave(2, 0)[:, : 5 + i])
        torch.testing.assert_close(out[:, i], expected)


def test_fp32_and_cpu_inputs_take_the_sdpa_path():
    q, _, _ = _qkv(4, dtype=torch.float32)
    assert not flash_varlen_supported(q)
    assert not flash_varlen_supported(q.bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cp_size", [1, 2])
def test_flash_varlen_matches_reference_forward_and_backward(cp_size):
    """bf16 FlashAttention varlen (GQA, CP chunks with gathered keys) against fp64 attention: output and the
    gradients of q, k, v agree to bf16 precision (relative error < 2e-2)."""
    lengths = [37, 300, 1, 129, 64]
    scale = 128**-0.5
    base = PackedLayout.for_parallelism(lengths, 1, False, cp_size, 0, "cuda")
    q, k, v = _qkv(base.cu_seqlens[-1], heads=8, groups=2, dim=128, device="cuda", seed=3)
    grad = torch.randn_like(q)
    for rank in range(cp_size):
        layout = PackedLayout.for_parallelism(lengths, 1, False, cp_size, rank, "cuda")
        local = layout.local_positions
        everyone = torch.cat(
            [PackedLayout(lengths, cp_size, r, layout.multiple).positions(r) for r in range(cp_size)]
        ).cuda()
        qb, kb, vb = (x.detach().bfloat16().requires_grad_() for x in (q, k, v))
        k_all, v_all = (x[everyone].index_select(0, layout.gathered_index) for x in (kb, vb))
        assert flash_varlen_supported(qb)
        out = packed_causal_attention(qb[local], k_all, v_all, layout.attention_blocks, scale)
        out.backward(grad[local].bfloat16())
        qd, kd, vd = (x.detach().clone().requires_grad_() for x in (q, k, v))
        want = reference_attention(qd, kd, vd, base.padded_lengths, scale)
        want[local].backward(grad[local].double())
        for got, expected in [(out, want[local]), (qb.grad, qd.grad), (kb.grad, kd.grad), (vb.grad, vd.grad)]:
            error = (got.double() - expected).norm() / expected.norm()
            assert error < 2e-2, float(error)
