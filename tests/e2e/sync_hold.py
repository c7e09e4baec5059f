"""A test's hold point in the weight sync: a ``--custom-update-weight-paused-path`` hook (``sync_hold.hold``, with this
directory on ``PYTHONPATH``) that the fault-tolerance tests install to act in the middle of a sync.

With ``$VIME_TEST_HOLD_SYNC_DIR`` set (the runs inherit it; Ray's workers too) and a file ``hold_<version>`` in that
directory, sync ``version`` writes ``paused_<version>`` there once every engine it reaches is paused and waits (up to
10 minutes) until the test removes ``hold_<version>``, e.g. after killing an engine in the middle of the sync."""

from __future__ import annotations

import os
import time
from pathlib import Path

HOLD_ENV = "VIME_TEST_HOLD_SYNC_DIR"
HOOK = "sync_hold.hold"  # the flag's value
HOOK_DIR = str(Path(__file__).resolve().parent)  # what PYTHONPATH needs for HOOK to import
HOLD_LIMIT_S = 600.0


def hold(args, version: int, engine_urls: list[str]) -> None:
    """``--custom-update-weight-paused-path``: hold sync ``version`` while ``hold_<version>`` exists (see above)."""
    directory = os.environ.get(HOLD_ENV)
    if not directory or not (held := Path(directory) / f"hold_{version}").exists():
        return
    (Path(directory) / f"paused_{version}").touch()
    deadline = time.monotonic() + HOLD_LIMIT_S
    while held.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
