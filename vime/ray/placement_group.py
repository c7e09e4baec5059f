"""Ray resources for the actor, critic and rollout engines: GPU bundles when the cluster has GPUs, else CPU.

slime's layout: with ``--colocate`` the rollout engines share the actor's bundles; otherwise the actor's
bundles come first and the rollout's after them, in one placement group.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group

PLACEMENT_TIMEOUT_S = 600


@dataclass
class Bundles:
    """A placement group and the bundle indices one role may use."""

    group: PlacementGroup
    indices: list[int]
    resource: str  # "GPU" or "CPU": what one bundle holds one unit of


def bundle_resource() -> str:
    """``"GPU"`` when the Ray cluster has GPUs, else ``"CPU"`` (the CPU quick start and tests)."""
    return "GPU" if ray.cluster_resources().get("GPU", 0) >= 1 else "CPU"


def bundle_counts(args) -> dict[str, int]:
    """Bundles each role reserves: ``actor``, ``critic`` (ppo only) and ``rollout`` (none when colocated)."""
    num_actor = 0 if args.debug_rollout_only else args.actor_num_nodes * args.actor_num_gpus_per_node
    num_critic = (
        args.critic_num_nodes * args.critic_num_gpus_per_node
        if args.advantage_estimator == "ppo" and not args.debug_rollout_only
        else 0
    )
    num_rollout = 0 if (args.colocate or args.debug_train_only) else args.rollout_num_gpus
    return {"actor": num_actor, "critic": num_critic, "rollout": num_rollout}


def num_bundles(args) -> int:
    """Size of the run's placement group."""
    return sum(bundle_counts(args).values()) or 1


def create_placement_groups(args) -> dict[str, Bundles]:
    """Reserve the bundles of :func:`bundle_counts` in one group and wait until they are placed."""
    resource = bundle_resource()
    sizes = bundle_counts(args)
    total = num_bundles(args)
    group = placement_group([{resource: 1} for _ in range(total)], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise RuntimeError(
            f"Ray could not place {total} {resource} bundles ({sizes}) within {PLACEMENT_TIMEOUT_S} s; the cluster "
            f"has {ray.cluster_resources()}. Lower the --actor-*/--critic-*/--rollout-num-gpus counts or add nodes"
        ) from None
    result, start = {}, 0
    for role, size in sizes.items():
        result[role] = Bundles(group, list(range(start, start + size)), resource)
        start += size
    if args.colocate:
        result["rollout"] = Bundles(group, result["actor"].indices[: args.rollout_num_gpus], resource)
    return result
