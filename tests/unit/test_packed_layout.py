"""The packed-row layout for Megatron's sequence and context parallelism, simulated on CPU: every CP rank's share
of the attention and of the logit rows, put back together, equals the unsplit computation."""

from __future__ import annotations

import math

import pytest
import torch

from vime.backends.megatron_utils.packed_layout import PackedLayout, attend_blocks, causal_attention

LENGTHS = [5, 12, 1, 9, 3]


def _reference_attention(q, k, v, lengths, scale):
    """Per-sequence causal softmax attention written out with an explicit mask; q [T, heads, d], k/v [T, g, d]."""
    heads, groups = q.shape[1], k.shape[1]
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = q[start : start + n], k[start : start + n], v[start : start + n]
        ks, vs = (x.repeat_interleave(heads // groups, dim=1) for x in (ks, vs))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs).reshape(n, -1))
        start += n
    return torch.cat(outs)


def test_padding_maps_every_token_and_keeps_sequences_apart():
    layout = PackedLayout(LENGTHS, cp_size=2, cp_rank=0, multiple=4)
    assert layout.padded_lengths == [8, 12, 4, 12, 4]
    assert layout.cu_seqlens == [0, 8, 20, 24, 36, 40]
    ids = torch.arange(1, sum(LENGTHS) + 1)
    padded = layout.pad(ids, value=0)
    assert padded.tolist()[:8] == [1, 2, 3, 4, 5, 0, 0, 0]
    assert padded.tolist()[20:24] == [18, 0, 0, 0]
    assert torch.equal(padded[layout.to_padded(torch.arange(len(ids)))], ids)
    with pytest.raises(ValueError, match="multiple of 2 x cp_size"):
        PackedLayout(LENGTHS, cp_size=2, multiple=2)


@pytest.mark.parametrize("cp_size", [2, 3])
def test_cp_ranks_hold_disjoint_balanced_chunks(cp_size):
    layouts = [PackedLayout.for_parallelism(LENGTHS, 2, True, cp_size, r, "cpu") for r in range(cp_size)]
    held = torch.cat([x.local_positions for x in layouts])
    assert sorted(held.tolist()) == list(range(layouts[0].cu_seqlens[-1]))  # each position exactly once
    assert len({len(x.local_positions) for x in layouts}) == 1
    assert layouts[0].local_length % 2 == 0  # SP then splits each rank's rows over TP=2
    # rank 0 holds the first and the last chunk of the 8-token (padded 8 = 2 x 2 x 2) first sequence
    if cp_size == 2:
        assert layouts[0].local_positions[:4].tolist() == [0, 1, 6, 7]
    # the all-gather of the ranks' rows, re-indexed, is the padded row
    gathered = held[layouts[1].gathered_index]
    assert torch.equal(gathered, torch.arange(layouts[0].cu_seqlens[-1]))


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_context_parallel_attention_matches_unsplit_attention(cp_size):
    torch.manual_seed(0)
    heads, groups, dim = 4, 2, 16
    scale = dim**-0.5
    base = PackedLayout.for_parallelism(LENGTHS, 1, False, cp_size, 0, "cpu")
    total = base.cu_seqlens[-1]
    q = torch.randn(total, heads, dim, dtype=torch.float64)
    k, v = (torch.randn(total, groups, dim, dtype=torch.float64) for _ in range(2))
    reference = _reference_attention(q, k, v, base.padded_lengths, scale)
    for rank in range(cp_size):
        layout = PackedLayout.for_parallelism(LENGTHS, 1, False, cp_size, rank, "cpu")
        # what the all-gather of every rank's local keys/values, re-indexed, gives each rank
        everyone = torch.cat(
            [PackedLayout(LENGTHS, cp_size, r, layout.multiple).positions(r) for r in range(cp_size)]
        )
        k_all, v_all = (x[everyone].index_select(0, layout.gathered_index) for x in (k, v))
        out = attend_blocks(q[layout.local_positions], k_all, v_all, layout.query_blocks(), scale)
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


@pytest.mark.parametrize(("cp_size", "sequence_parallel"), [(1, False), (1, True), (2, True), (3, False)])
def test_logit_rows_and_labels_come_back_in_order(cp_size, sequence_parallel):
    ids = torch.randint(0, 50, (sum(LENGTHS),))
    rows = torch.tensor([2, 3, 6, 10, 15, 18, 19, 22, 25, 27, 28])  # each predicts a token of its sequence
    pieces = []
    for rank in range(cp_size):
        layout = PackedLayout.for_parallelism(LENGTHS, 2, sequence_parallel, cp_size, rank, "cpu")
        local_rows, order = layout.logit_rows(rows)
        labels = layout.labels(ids, local_rows)
        pieces.append(labels)
        if cp_size == 1:
            assert order is None and torch.equal(labels, ids[rows + 1])
    if cp_size > 1:
        assert len({len(p) for p in pieces}) == 1  # padded to the same count: an even all-gather
        assert torch.equal(torch.cat(pieces)[order], ids[rows + 1])
