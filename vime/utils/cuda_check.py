"""Whether this process can use CUDA, without importing torch where its build cannot (importing torch costs a
process about 3 s of CPU; an engine's launcher needs only the answer)."""

from __future__ import annotations

import functools
import importlib.metadata


@functools.cache
def cuda_available() -> bool:
    """``torch.cuda.is_available()``; ``False`` at once for a CPU-only torch build (a ``+cpu`` version)."""
    try:
        if "+cpu" in importlib.metadata.version("torch"):
            return False
    except importlib.metadata.PackageNotFoundError:
        pass
    import torch

    return torch.cuda.is_available()
