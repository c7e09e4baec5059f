"""Parse-time checks of the flags that keep engines serving across weight syncs and across runs:
``--flush-cache-interval`` (in-flight weight updates, :mod:`vime.utils.inflight`) and ``--rollout-session-id``
(engines kept across a trainer failure; :mod:`vime.ray.serving_session` does the rest when the run starts).
Errors name the flag and the fix."""

from __future__ import annotations

import argparse
import logging
import re

from vime.utils.inflight import DEFAULT_ROLLOUT, FULLY_ASYNC_ROLLOUT

logger = logging.getLogger(__name__)

_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_flush_cache_interval(args: argparse.Namespace) -> None:
    """Parse-time checks; ``N <= 0`` with the default rollout function selects the fully-async one (upstream)."""
    interval = args.flush_cache_interval
    if interval is None:
        return
    if args.use_score_centering:
        raise ValueError(
            f"--flush-cache-interval {interval} asks vLLM for per-token weight versions through /inference/v1/generate, "
            "whose log-probs name no token ids for --use-score-centering's top-k heads; drop one of the two flags"
        )
    if interval > 0:
        return
    if args.colocate or args.offload_rollout:
        raise ValueError(
            f"--flush-cache-interval {interval} keeps requests running across weight syncs, but with --colocate / "
            "--offload-rollout the engines sleep while the trainer trains; give the engines their own GPUs, or use "
            "--flush-cache-interval 1 (a full refresh at every sync)"
        )
    if args.debug_train_only or args.debug_rollout_only:
        raise ValueError(
            f"--flush-cache-interval {interval} overlaps rollout and training (fully async), but --debug-train-only "
            "/ --debug-rollout-only runs one side only; drop one of the flags"
        )
    if args.rollout_function_path == DEFAULT_ROLLOUT:
        args.rollout_function_path = FULLY_ASYNC_ROLLOUT
        logger.info("--flush-cache-interval %d: rollout function %s", interval, FULLY_ASYNC_ROLLOUT)


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
