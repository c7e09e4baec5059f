"""Where the tokens of a packed micro-batch live when Megatron splits the sequence dimension, and causal
attention over that layout.

*Sequence parallelism* (SP) splits the packed row evenly over the tensor-parallel ranks between the layers, so
the row's length must be a multiple of TP. *Context parallelism* (CP) gives CP rank ``r`` two of the ``2·cp``
equal chunks of every sequence, chunk ``r`` and chunk ``2·cp-1-r`` (so every rank does the same causal work):
the layout Megatron-Core's packed (THD) RoPE expects. Every sequence is padded at its end to a multiple of
``2·cp`` (times TP with SP); pad tokens come after the real ones, so causal attention keeps them out of every
real token's output. Attention over the layout is ``vime.utils.varlen_attention`` on :attr:`attention_blocks`.

Plain torch, no Megatron import: the layout is built on the host once per micro-batch and tested on CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate

import torch

from vime.utils.varlen_attention import VarlenBlocks


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class PackedLayout:
    """A packed row of sequences of ``lengths``, each padded to a multiple of ``multiple``, of which this rank
    (``cp_rank`` of ``cp_size``) holds the CP layout's share. Index tensors are on ``device``."""

    lengths: list[int]
    cp_size: int = 1
    cp_rank: int = 0
    multiple: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # the whole padded row's length is a multiple of this too (its last sequence pads more)
    row_multiple: int = 1

    def __post_init__(self):
        if self.cp_size > 1 and self.multiple % (2 * self.cp_size):
            raise ValueError(f"multiple={self.multiple} must be a multiple of 2 x cp_size={self.cp_size}")
        self.padded_lengths = [_round_up(n, self.multiple) for n in self.lengths]
        if self.padded_lengths and self.row_multiple > 1:
            # a multiple of both, so the last sequence stays a multiple of ``multiple`` (its CP chunks stay even)
            step = math.lcm(self.row_multiple, self.multiple)
            self.padded_lengths[-1] += _round_up(sum(self.padded_lengths), step) - sum(self.padded_lengths)
        self.cu_seqlens = [0, *accumulate(self.padded_lengths)]  # padded starts, then the padded total

    @classmethod
    def for_parallelism(
        cls,
        lengths: list[int],
        tp_size: int,
        sequence_parallel: bool,
        cp_size: int,
        cp_rank: int,
        device,
        pad_size_multiplier: int = 1,
    ) -> PackedLayout:
        """The layout Megatron needs for ``lengths`` under the given SP and CP; with ``pad_size_multiplier``
        (``--data-pad-size-multiplier``, slime) each CP rank's share of the row is a multiple of it x TP."""
        multiple = (2 * cp_size if cp_size > 1 else 1) * (tp_size if sequence_parallel else 1)
        row_multiple = pad_size_multiplier * tp_size * cp_size if pad_size_multiplier > 1 else 1
        return cls(lengths, cp_size, cp_rank, multiple, torch.device(device), row_multiple)

    @property
    def local_length(self) -> int:
        """Tokens this CP rank holds (the same on every CP rank)."""
        return self.cu_seqlens[-1] // self.cp_size

    def _chunks(self, rank: int) -> list[tuple[int, int, int]]:
        """``(sequence start, chunk start, chunk end)`` of the padded-row chunks CP rank ``rank`` holds, in its
        local order (without CP: every whole sequence)."""
        if self.cp_size == 1:
            return [(s, s, e) for s, e in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:], strict=True)]
        out = []
        for start, length in zip(self.cu_seqlens[:-1], self.padded_lengths, strict=True):
            chunk = length // (2 * self.cp_size)
            for index in (rank, 2 * self.cp_size - 1 - rank):
                out.append((start, start + index * chunk, start + (index + 1) * chunk))
        return out

    def positions(self, rank: int) -> torch.Tensor:
        """Padded-row positions that CP rank ``rank`` holds, in its local order (CPU)."""
        return torch.cat([torch.arange(a, b) for _, a, b in self._chunks(rank)])

    @cached_property
    def local_positions(self) -> torch.Tensor:
        """Padded-row positions this rank holds, in local order."""
        return self.positions(self.cp_rank).to(self.device, non_blocking=True)

    @cached_property
    def rope_positions(self) -> torch.Tensor:
        """Each local row's position within its padded sequence (what its rotary embedding encodes)."""
        positions = self.positions(self.cp_rank)
        sequence = torch.bucketize(positions, torch.tensor(self.cu_seqlens[1:]), right=True)
        starts = torch.tensor(self.cu_seqlens[:-1])
        return (positions - starts[sequence]).to(self.device, non_blocking=True)

    @cached_property
    def _gathered_index_cpu(self) -> torch.Tensor:
        gathered = torch.cat([self.positions(r) for r in range(self.cp_size)])
        index = torch.empty_like(gathered)
        index[gathered] = torch.arange(len(gathered))
        return index

    @cached_property
    def gathered_index(self) -> torch.Tensor:
        """For each padded-row position, its row in the CP all-gather of every rank's local rows (rank-major)."""
        return self._gathered_index_cpu.to(self.device, non_blocking=True)

    def pad(self, row: torch.Tensor, value: int = 0) -> torch.Tensor:
        """The unpadded packed ``row`` ([T, ...]) laid out on the padded row, pads filled with ``value``."""
        out = row.new_full((self.cu_seqlens[-1], *row.shape[1:]), value)
        out[self.to_padded(torch.arange(len(row))).to(row.device, non_blocking=True)] = row
        return out

    def to_padded(self, index: torch.Tensor) -> torch.Tensor:
        """Unpadded packed-row positions -> padded-row positions (CPU)."""
        shift = torch.tensor(
            [p - u for p, u in zip(self.cu_seqlens, accumulate(self.lengths, initial=0), strict=True)]
        )
        sequence = torch.bucketize(index, torch.tensor(list(accumulate(self.lengths))), right=True)
        return index + shift[sequence]

    @cached_property
    def attention_blocks(self) -> VarlenBlocks:
        """Local query rows and the padded-row key range each attends to; each block's queries are the last
        ``q_end - q_start`` positions of its key range (causal)."""
        blocks, offset = [], 0
        for start, a, b in self._chunks(self.cp_rank):
            blocks.append((offset, offset + b - a, start, b))
            offset += b - a
        return VarlenBlocks(blocks, self.device)

    def logit_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """For unpadded packed-row positions ``rows`` (a batch's logit rows, in order): the local rows this rank
        holds, in order, and — with CP — where each of ``rows`` sits in the CP all-gather of every rank's rows.
        With CP every rank's list is padded (with local row 0) to the same length, so the gather is even."""
        where = self._gathered_index_cpu[self.to_padded(rows)]
        owner, local = where // self.local_length, where % self.local_length
        if self.cp_size == 1:
            return local.to(self.device, non_blocking=True), None
        most = int(torch.bincount(owner, minlength=self.cp_size).max())
        rank_of_row = torch.empty_like(owner)
        for rank in range(self.cp_size):
            mine = owner == rank
            rank_of_row[mine] = torch.arange(int(mine.sum()))
        held = local[owner == self.cp_rank]
        held = torch.cat([held, held.new_zeros(most - len(held))])
        return held.to(self.device, non_blocking=True), (owner * most + rank_of_row).to(
            self.device, non_blocking=True
        )

    def local_rows(self, row: torch.Tensor, tp_size: int = 1, tp_rank: int = 0) -> torch.Tensor:
        """The rows of an unpadded packed-row tensor ``row`` ([T, ...]) that this rank's layers see: its CP share
        (pads filled with zeros/False), and with sequence parallelism (``tp_size`` > 1) the ``tp_rank``-th of
        ``tp_size`` equal slices of that."""
        local = self.pad(row)[self.positions(self.cp_rank).to(row.device, non_blocking=True)]
        size = len(local) // tp_size
        return local[tp_rank * size : (tp_rank + 1) * size]

    def from_local_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`local_rows`: every CP rank's local rows (each gathered over its SP slices first),
        concatenated rank by rank -> the unpadded packed row."""
        padded = gathered[self._gathered_index_cpu.to(gathered.device)]
        return padded[self.to_padded(torch.arange(sum(self.lengths))).to(gathered.device)]

    def labels(self, input_ids: torch.Tensor, local_rows: torch.Tensor) -> torch.Tensor:
        """The token each of ``local_rows`` predicts (the next token of the padded row), from the unpadded
        ``input_ids`` on ``device``."""
        padded = self.pad(input_ids.to(self.device, non_blocking=True))
        return padded[(self.local_positions[local_rows] + 1).clamp(max=len(padded) - 1)]
