"""The ``tensor`` weight-sync transport's handle (DESIGN.md §5, colocated GPU runs): a flat byte buffer
(``vime.utils.weight_buckets.flatten_bucket``) shared with another process on the same GPU through CUDA IPC.

Everything crosses the engine's HTTP ``/collective_rpc`` route as JSON: the handle's bytes are base64 text and
the buffer's layout is a list of ``{name, dtype, shape, offset}``. No pickle is read from the wire.
"""

from __future__ import annotations

import base64

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor


def gpu_uuid(device: torch.device | int) -> str:
    """The physical GPU's UUID (the same in every process, whatever its ``CUDA_VISIBLE_DEVICES``)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def share_cuda_buffer(buffer: torch.Tensor) -> dict:
    """A JSON-able CUDA IPC handle of a 1-D ``uint8`` CUDA tensor. Keep ``buffer`` alive until the receiver is
    done with it (PyTorch then keeps the memory until the receiver drops its view)."""
    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError("share_cuda_buffer takes a 1-D uint8 CUDA tensor")
    _, fields = reduce_tensor(buffer)
    (_, _, _, tensor_offset, _, _, _, handle, storage_bytes, storage_offset, _, ref_handle, ref_offset,
     event_handle, event_sync) = fields  # fmt: skip
    return {
        "gpu": gpu_uuid(buffer.device),
        "numel": buffer.numel(),
        "tensor_offset": tensor_offset,
        "handle": _b64(handle),
        "storage_bytes": storage_bytes,
        "storage_offset": storage_offset,
        "ref_handle": _b64(ref_handle),
        "ref_offset": ref_offset,
        "event_handle": _b64(event_handle),
        "event_sync": event_sync,
    }


def open_cuda_buffer(shared: dict) -> torch.Tensor:
    """Map a :func:`share_cuda_buffer` handle into this process, on the current CUDA device, which must be the
    same physical GPU the sender used (CUDA IPC does not copy between GPUs)."""
    device = torch.cuda.current_device()
    if gpu_uuid(device) != shared["gpu"]:
        raise RuntimeError(
            f"CUDA IPC weight buffer is on GPU {shared['gpu']} but this engine worker runs on {gpu_uuid(device)}: "
            "the tensor transport needs each engine worker on its trainer rank's GPU (--colocate)"
        )
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([shared["numel"]]),
        (1,),
        shared["tensor_offset"],
        torch.storage.TypedStorage,
        torch.uint8,
        device,
        _unb64(shared["handle"]),
        shared["storage_bytes"],
        shared["storage_offset"],
        False,
        _unb64(shared["ref_handle"]),
        shared["ref_offset"],
        _unb64(shared["event_handle"]),
        shared["event_sync"],
    )
