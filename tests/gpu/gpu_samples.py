"""Samples for the GPU trainer tests: seeded random token sequences of the given (prompt, response) lengths, over the
tiny models' 61-token vocabulary (ids from 4: past the special tokens), rewards alternating 0 and 1."""

from __future__ import annotations

import torch

from vime.utils.types import Sample, Status


def random_samples(shapes: list[tuple[int, int]]) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    return [
        Sample(index=i, tokens=torch.randint(4, 61, (p + r,), generator=g).tolist(), response_length=r,
               reward=float(i % 2), status=Status.COMPLETED)
        for i, (p, r) in enumerate(shapes)
    ]  # fmt: skip
