"""Parse-time checks of ``--rollout-session-id`` (engines kept across a trainer failure; ``vime.ray.serving_session``
does the rest when the run starts)."""

from __future__ import annotations

import argparse
import re

_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_rollout_session(args: argparse.Namespace) -> None:
    """ValueError naming the flag and the fix for a session id that is no plain name, or a flag it cannot go with."""
    session = args.rollout_session_id
    if session is None:
        return
    if not _SESSION_ID.fullmatch(session):
        raise ValueError(
            f"--rollout-session-id {session!r}: use 1-64 letters, digits, '.', '_' or '-' (it names Ray actors)"
        )
    reasons = {
        "--colocate": args.colocate,  # the engines share the trainers' GPUs
        "--offload-rollout": args.offload_rollout,  # they sleep while the trainer trains
        "--rollout-external-engine-addrs": bool(args.rollout_external_engine_addrs),
        "--use-fault-tolerance": args.use_fault_tolerance,
        "--debug-train-only": args.debug_train_only,
    }
    if given := [flag for flag, on in reasons.items() if on]:
        raise ValueError(
            f"--rollout-session-id keeps the engines vime starts on rollout GPUs of their own, awake, across runs; "
            f"it does not go with {', '.join(given)} (colocated or sleeping engines live with their trainers, external "
            "engines outlive every run already, engine replacement under --use-fault-tolerance is not built for kept "
            "engines, --debug-train-only starts none): drop one of them"
        )
