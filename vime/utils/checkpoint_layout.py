"""The checkpoint layout every backend shares (DESIGN.md §7): ``DIR/iter_{rollout_id:07d}/`` per save and
``DIR/latest_checkpointed_iteration.txt`` naming the newest complete one; plus the host RNG state a resume
restores."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

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


def host_rng_state() -> dict:
    """torch (CPU), Python and NumPy generator states."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_host_rng_state(state: dict) -> None:
    """Restore :func:`host_rng_state` output."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
