"""Named tensors in buckets of bounded size (the unit every weight-sync transport moves), and a bucket flattened
into one byte buffer (what the ``distributed`` and ``tensor`` transports send) with a JSON layout to read it back.
The sender adds each tensor's checksum of its bytes in the buffer to the layout (:func:`add_checksums`), and the
receiver checks them before loading (:func:`verify_checksums`): a tensor changed on the way stops the sync, named.

A bucket entry may be a :class:`StackedTensor`: equal-shaped parts that travel as one tensor ``[parts, *shape]``
without ever being stacked in memory (:func:`flatten_bucket` writes the parts straight into the buffer).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch


class StackedTensor:
    """``torch.stack(parts)``, not yet computed: what a bucket needs of a tensor (``shape``, ``dtype``, ``numel``,
    ``element_size``) plus :meth:`write_into`, which stacks the parts straight into a buffer."""

    def __init__(self, parts: Sequence[torch.Tensor]):
        first = parts[0]
        if any(p.shape != first.shape or p.dtype != first.dtype for p in parts):
            raise ValueError(
                f"stacked parts differ in shape or dtype: {[(tuple(p.shape), p.dtype) for p in parts]}"
            )
        self.parts = list(parts)
        self.shape = torch.Size([len(self.parts), *first.shape])
        self.dtype = first.dtype

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def write_into(self, out: torch.Tensor) -> None:
        """Stack the parts into ``out`` (shape :attr:`shape`, the parts' device): one copy (on CUDA one batched copy
        kernel), no intermediate tensor."""
        torch.stack([p.detach() for p in self.parts], out=out)


Bucket = list[tuple[str, torch.Tensor | StackedTensor]]
ALIGN_BYTES = 64  # every tensor starts at a multiple of this in a flat buffer (any dtype can view it)


def in_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor | StackedTensor]], buffer_bytes: int
) -> Iterator[Bucket]:
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


def with_last_flag(buckets: Iterable[Bucket]) -> Iterator[tuple[Bucket, bool]]:
    """``(bucket, is_last)`` pairs, looking one bucket ahead."""
    previous = None
    for bucket in buckets:
        if previous is not None:
            yield previous, False
        previous = bucket
    if previous is not None:
        yield previous, True


def bucket_layout(bucket: Bucket) -> tuple[list[dict], int]:
    """Where each tensor of ``bucket`` sits in its flat buffer (``{name, dtype, shape, offset}``, JSON-able), and
    the buffer's size in bytes."""
    layout, offset = [], 0
    for name, tensor in bucket:
        dtype = str(tensor.dtype).removeprefix("torch.")
        layout.append({"name": name, "dtype": dtype, "shape": list(tensor.shape), "offset": offset})
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN_BYTES) * ALIGN_BYTES
    return layout, offset


def flatten_bucket(
    bucket: Bucket, device: torch.device, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[dict]]:
    """Copy the bucket's tensors into one ``uint8`` buffer on ``device`` (the front of ``out`` when that is large
    enough, else a new one); returns the buffer (exactly the bucket's size) and its layout."""
    layout, nbytes = bucket_layout(bucket)
    if out is None or out.numel() < nbytes or out.device != torch.device(device):
        out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    buffer = out[:nbytes]
    for entry, (_, tensor) in zip(layout, bucket, strict=True):
        size = tensor.numel() * tensor.element_size()
        target = buffer[entry["offset"] : entry["offset"] + size].view(tensor.dtype).view(tensor.shape)
        if isinstance(tensor, StackedTensor):
            tensor.write_into(target)
        else:
            target.copy_(tensor.detach(), non_blocking=True)
    return buffer, layout


def unflatten_bucket(buffer: torch.Tensor, layout: list[dict]) -> Bucket:
    """The named tensors of a :func:`flatten_bucket` buffer, as views of it (no copy)."""
    bucket = []
    for entry in layout:
        dtype = getattr(torch, entry["dtype"])
        numel = 1
        for size in entry["shape"]:
            numel *= size
        nbytes = numel * dtype.itemsize
        view = buffer[entry["offset"] : entry["offset"] + nbytes].view(dtype).view(entry["shape"])
        bucket.append((entry["name"], view))
    return bucket


def _word_sum(data: torch.Tensor) -> torch.Tensor:
    """The bytes of ``data`` (a contiguous ``uint8`` view) summed as int32 words (int16 or uint8 where their number is
    not a multiple of 4 or 2), in int64, on their device: one read, no temporary copy, exact."""
    word = next(w for w in (torch.int32, torch.int16, torch.uint8) if data.numel() % w.itemsize == 0)
    return data.view(word).sum(dtype=torch.int64)


def _checksums(buffer: torch.Tensor, layout: list[dict]) -> list[int]:
    """Each layout entry's checksum (:func:`_word_sum` of its bytes in ``buffer``); one transfer of all the sums."""
    sums = []
    for entry in layout:
        dtype = getattr(torch, entry["dtype"])
        nbytes = dtype.itemsize
        for size in entry["shape"]:
            nbytes *= size
        sums.append(_word_sum(buffer[entry["offset"] : entry["offset"] + nbytes]))
    return torch.stack(sums).tolist() if sums else []


def tensor_checksums(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Each tensor's checksum of its bytes as it lies in memory (:func:`_word_sum`; a non-contiguous one is copied
    first; a tensor without storage, on the meta device, counts 0), with one transfer of the sums per device (some
    parameters may live in host memory, e.g. vLLM's ``--cpu-offload-gb``): what an engine holds, to compare with what
    it held (or a peer holds)."""
    sums = [
        torch.zeros((), dtype=torch.int64)
        if t.is_meta
        else _word_sum(t.detach().contiguous().reshape(-1).view(torch.uint8))
        for t in tensors
    ]
    values = [0] * len(sums)
    for device in {s.device for s in sums}:
        where = [i for i, s in enumerate(sums) if s.device == device]
        for i, value in zip(where, torch.stack([sums[i] for i in where]).tolist(), strict=True):
            values[i] = value
    return values


def add_checksums(buffer: torch.Tensor, layout: list[dict]) -> None:
    """Record each tensor's checksum in ``buffer`` in its layout entry (``checksum``), for the receiver to check."""
    for entry, value in zip(layout, _checksums(buffer, layout), strict=True):
        entry["checksum"] = value


def verify_checksums(buffer: torch.Tensor, layout: list[dict]) -> None:
    """Raise ``ValueError`` naming the first tensor whose bytes in ``buffer`` do not have the checksum the sender
    recorded (entries without one are not checked)."""
    for entry, value in zip(layout, _checksums(buffer, layout), strict=True):
        if "checksum" in entry and value != entry["checksum"]:
            raise ValueError(
                f"weight sync: {entry['name']} ({entry['dtype']}, shape {entry['shape']}) arrived changed: its "
                f"bytes sum to {value}, the trainer sent {entry['checksum']}"
            )
