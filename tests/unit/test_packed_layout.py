"""The packed-row layout for Megatron's sequence and context parallelism, simulated on CPU: every CP rank's share
of the logit rows, put back together, equals the unsplit computation (attention: test_varlen_attention.py)."""

from __future__ import annotations

import pytest
import torch

from vime.backends.megatron_utils.packed_layout import PackedLayout

LENGTHS = [5, 12, 1, 9, 3]


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


def test_rope_positions_restart_in_every_sequence():
    layout = PackedLayout(LENGTHS, cp_size=2, cp_rank=0, multiple=4)  # padded [8, 12, 4, 12, 4]
    assert layout.rope_positions[:10].tolist() == [0, 1, 6, 7, 0, 1, 2, 9, 10, 11]
    whole = PackedLayout(LENGTHS)
    assert whole.rope_positions.tolist() == [i for n in LENGTHS for i in range(n)]


def test_data_pad_size_multiplier_pads_the_row_at_its_end():
    """--data-pad-size-multiplier 4 with TP 2 + SP and CP 2: each CP rank holds a multiple of 4 x TP rows; only the
    last sequence grows (at its end), so every real token keeps its place and every sequence its even CP chunks."""
    lengths = [5, 7, 3]
    plain = PackedLayout.for_parallelism(lengths, 2, True, 2, 0, "cpu")
    padded = PackedLayout.for_parallelism(lengths, 2, True, 2, 0, "cpu", pad_size_multiplier=4)
    assert plain.padded_lengths == [8, 8, 8]
    assert padded.padded_lengths == [8, 8, 16] and padded.local_length % (4 * 2) == 0
    real = torch.arange(sum(lengths))
    assert torch.equal(padded.to_padded(real), plain.to_padded(real))
    assert torch.equal(padded.logit_rows(real[:-1])[0], plain.logit_rows(real[:-1])[0])
    assert PackedLayout.for_parallelism(
        lengths, 2, True, 2, 0, "cpu", pad_size_multiplier=1
    ).padded_lengths == [8, 8, 8]
