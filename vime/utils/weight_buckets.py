"""Group named tensors into buckets of bounded size, the unit every weight-sync transport moves."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

Bucket = list[tuple[str, torch.Tensor]]


def in_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], buffer_bytes: int) -> Iterator[Bucket]:
    """Consecutive ``(name, tensor)`` pairs in lists of at most ``buffer_bytes`` (a larger tensor is alone)."""
    bucket: Bucket = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > buffer_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
