"""The experts an MoE model routed each token to, as a compact integer array (``Sample.rollout_routed_experts``).

Shape ``[rows, num_layers, topk]``: row ``p`` holds, for the token at position ``p`` of ``Sample.tokens`` (prompt
and response alike), the ``topk`` experts each layer chose (layers counted from 0 over all decoder layers; a
dense layer's row is unused). An engine returns ``len(tokens) - 1`` rows: the last sampled token was never fed
back through the model. Stored as ``uint8`` (fewer than 256 experts), else ``uint16``/``int32``; in JSON (data
buffer state, ``--save-debug-rollout-data``) as base64 of the ``.npy`` bytes, vLLM's own wire format.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np


def compact(array: Any) -> np.ndarray:
    """``array`` (nested lists, a numpy array or a torch tensor of non-negative expert ids) as a 3-D array of the
    narrowest unsigned dtype that holds its values."""
    if hasattr(array, "detach"):  # a torch tensor
        array = array.detach().cpu().numpy()
    array = np.asarray(array)
    if array.ndim != 3:
        raise ValueError(f"routed experts must be [tokens, layers, topk]; got shape {array.shape}")
    if array.size and (not np.issubdtype(array.dtype, np.integer) or array.min() < 0):
        raise ValueError(f"routed experts must be non-negative integers; got dtype {array.dtype}")
    largest = int(array.max()) if array.size else 0
    dtype = np.uint8 if largest < 2**8 else np.uint16 if largest < 2**16 else np.int32
    return array.astype(dtype, copy=False)


def encode(array: np.ndarray) -> str:
    """Base64 of the ``.npy`` bytes of ``array`` (what vLLM sends; :func:`decode` reads it back)."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode(value: Any) -> np.ndarray | None:
    """A routed-experts value as JSON or an engine carries it (base64 ``.npy`` string, nested lists as slime's
    ``Sample.to_dict`` writes them, an array or tensor, or None) -> a compact array, or None."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = np.load(io.BytesIO(base64.b64decode(value, validate=True)), allow_pickle=False)
        except ValueError as exc:
            raise ValueError(f"routed experts: not base64 of a .npy array ({exc})") from None
    return compact(value)
