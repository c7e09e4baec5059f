"""Ray resources for the actor, critic and rollout engines: GPU bundles when the cluster has GPUs, else CPU.

slime's layout: with ``--colocate`` the rollout engines share the actor's bundles; otherwise the actor's
bundles come first and the rollout's after them, in one placement group.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group


@dataclass
class Bundles:
    """A placement group and the bundle indices one role may use."""

    group: PlacementGroup
    indices: list[int]
    resource: str  # "GPU" or "CPU": what one bundle holds one unit of


def bundle_resource() -> str:
    """``"GPU"`` when the Ray cluster has GPUs, else ``"CPU"`` (the CPU quick start and tests)."""
    return "GPU" if ray.cluster_resources().get("GPU", 0) >= 1 else "CPU"


def create_placement_groups(args) -> dict[str, Bundles]:
    """Reserve bundles for ``actor``, ``critic`` (ppo only) and ``rollout`` and wait until they are placed."""
    resource = bundle_resource()
    num_actor = 0 if args.debug_rollout_only else args.actor_num_nodes * args.actor_num_gpus_per_node
    num_critic = (
        args.critic_num_nodes * args.critic_num_gpus_per_node
        if args.advantage_estimator == "ppo" and not args.debug_rollout_only
        else 0
    )
    num_rollout = 0 if (args.colocate or args.debug_train_only) else args.rollout_num_gpus
    sizes = {"actor": num_actor, "critic": num_critic, "rollout": num_rollout}
    total = sum(sizes.values()) or 1
    group = placement_group([{resource: 1} for _ in range(total)], strategy="PACK")
    ray.get(group.ready(), timeout=600)
    result, start = {}, 0
    for role, size in sizes.items():
        result[role] = Bundles(group, list(range(start, start + size)), resource)
        start += size
    if args.colocate:
        result["rollout"] = Bundles(group, result["actor"].indices[: args.rollout_num_gpus], resource)
    return result
