"""The checkpoint layout every backend shares (DESIGN.md §7): ``DIR/iter_{rollout_id:07d}/`` per save and
``DIR/latest_checkpointed_iteration.txt`` naming the newest complete one; plus the host RNG state a resume
restores."""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

LATEST_FILE = "latest_checkpointed_iteration.txt"


def iteration_dir(save_dir: str | Path, rollout_id: int) -> Path:
    """``save_dir/iter_{rollout_id:07d}``."""
    return Path(save_dir) / f"iter_{rollout_id:07d}"


def latest_iteration(load_dir: str | Path | None) -> int | None:
    """The rollout id in ``load_dir/latest_checkpointed_iteration.txt``; None if there is no checkpoint."""
    if not load_dir:
        return None
    path = Path(load_dir) / LATEST_FILE
    return int(path.read_text().strip()) if path.is_file() else None


def mark_latest(save_dir: str | Path, rollout_id: int) -> None:
    """Declare ``iter_{rollout_id}`` complete (call once every rank's files are written)."""
    (Path(save_dir) / LATEST_FILE).write_text(str(rollout_id))


def write_json_atomic(path: str | Path, value: Any) -> None:
    """Write ``value`` as JSON to ``path`` through a temporary file in its directory and a rename, so that a crash
    never leaves a half-written file (the directory is made if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(value, handle)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def host_rng_state() -> dict:
    """torch (CPU), Python and NumPy generator states."""
    import torch  # here: the driver reads the layout (through the rollout data source) but never holds tensors

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_host_rng_state(state: dict) -> None:
    """Restore :func:`host_rng_state` output."""
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
