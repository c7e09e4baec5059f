"""Engines kept serving across a trainer failure (``--rollout-session-id ID``) on an existing Ray cluster.

Starting vLLM engines takes minutes on real models; a trainer crash (an OOM, a killed driver) should not cost that.
With the flag the run's engines outlive its driver, and ``train.py`` resubmitted to the same cluster with the same ID
finds them again: it starts new trainers, a new rollout manager and router, loads ``--load``'s last checkpoint,
pushes those weights into the kept engines before rollout 0 (as with ``--rollout-external-engine-addrs``) and goes on.

- The driver joins the cluster at ``RAY_ADDRESS`` in the namespace :data:`NAMESPACE`, where names resolve across
  drivers (a run's own local Ray dies with its driver, so the flag needs a cluster).
- The rollout bundles are a detached placement group named ``vime/ID/rollout``, made by the first run and found by
  the next (the trainers' bundles stay the run's own).
- Each engine is a detached actor ``vime/ID/engine-SLOT`` (``vime.ray.engine_actor.NodeEngine``) in its bundle; its
  vLLM server is started once. A run adopts a kept engine only if the server is up, it would start the same vLLM
  command (model and flags; host and port aside), and the run that claimed it last is over (Ray's job table); else it
  stops with the reason (a dead server is replaced).
- The engines check the control secret of the run that started them; a resubmitted driver adopts it from engine 0
  before any of its actors start.
- A run that ends normally stops the engines and removes the bundles; one that fails, or whose driver is killed,
  leaves them (its trainers, rollout manager and router end with its Ray job).

Upstream vime keeps a whole serving deployment (placements, routers, engines, its queue) in one named detached
``ServingCluster`` actor (``vime/ray/serving.py`` of vllm-project/vime) and replays uncheckpointed batches; vime keeps
only the engines, the part that is slow to bring back, and resumes from the last checkpoint.
"""

from __future__ import annotations

import ray
from ray._private import state as ray_state
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    remove_placement_group,
)

NAMESPACE = "vime-serving"
CALL_TIMEOUT_S = 60.0


def engine_name(session: str, slot: int) -> str:
    return f"vime/{session}/engine-{slot}"


def bundles_name(session: str) -> str:
    return f"vime/{session}/rollout"


def find_engine(session: str, slot: int) -> ray.actor.ActorHandle | None:
    """The kept engine actor of ``slot``, if the session has one."""
    try:
        return ray.get_actor(engine_name(session, slot), namespace=NAMESPACE)
    except ValueError:
        return None


def session_secret(session: str) -> str | None:
    """The control secret the session's engines check (engine 0's), or None when the session has no engine yet."""
    actor = find_engine(session, 0)
    return None if actor is None else ray.get(actor.control_secret.remote(), timeout=CALL_TIMEOUT_S)


def rollout_group(session: str, count: int, resource: str) -> PlacementGroup:
    """The session's rollout bundles: ``count`` bundles of one ``resource`` each, made detached on first use;
    ValueError when the session holds others."""
    wanted = [{resource: 1.0} for _ in range(count)]
    try:
        group = get_placement_group(bundles_name(session))
    except ValueError:
        return placement_group(wanted, strategy="PACK", name=bundles_name(session), lifetime="detached")
    held = [{key: float(value) for key, value in bundle.items()} for bundle in group.bundle_specs]
    if held != wanted:
        raise ValueError(
            f"--rollout-session-id {session}: the session holds rollout bundles {held}, this run asks for {wanted} "
            "(--rollout-num-gpus): run with the session's counts, or use another session id"
        )
    return group


def job_is_running(job_id: str) -> bool:
    """Whether Ray's job table has ``job_id`` (hex) and it is not over."""
    return any(job["JobID"] == job_id and not job["IsDead"] for job in ray_state.jobs())


def release(session: str) -> None:
    """Remove the session's rollout bundles (once its engines are stopped)."""
    try:
        remove_placement_group(get_placement_group(bundles_name(session)))
    except ValueError:
        pass
