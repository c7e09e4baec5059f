"""A test's hold point at the start of a rollout: a ``--rollout-function-path`` (``rollout_hold.generate_rollout``, with
this directory and the repository root on ``PYTHONPATH``) that the fault-tolerance tests install to act before a
rollout sends its first request.

It is ``bench.fixed_length.generate_rollout`` (every response exactly ``--rollout-max-response-len`` tokens), except
that with ``$VIME_TEST_HOLD_SYNC_DIR`` set (see ``sync_hold``) and a file ``hold_rollout_<id>`` in that directory,
rollout ``id`` writes ``started_rollout_<id>`` there and waits (up to 10 minutes) until the test removes
``hold_rollout_<id>``: e.g. after freezing the engines, so that the rollout's requests reach them frozen."""

from __future__ import annotations

import os
import time
from pathlib import Path

from sync_hold import HOLD_ENV, HOLD_LIMIT_S

from bench import fixed_length

FUNCTION = "rollout_hold.generate_rollout"  # the flag's value


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False):
    """``--rollout-function-path``: hold rollout ``rollout_id`` while ``hold_rollout_<rollout_id>`` exists."""
    directory = os.environ.get(HOLD_ENV)
    if not evaluation and directory and (held := Path(directory) / f"hold_rollout_{rollout_id}").exists():
        (Path(directory) / f"started_rollout_{rollout_id}").touch()
        deadline = time.monotonic() + HOLD_LIMIT_S
        while held.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return fixed_length.generate_rollout(args, rollout_id, data_source, evaluation)
