"""The rollout manager as a Ray actor (a thin shell over ``vime.rollout.rollout_manager.RolloutManager``)."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime.ray.placement_group import Bundles
from vime.rollout.rollout_manager import RolloutManager

# Engines run as subprocesses of this actor, inside the rollout bundle it is placed in.
RolloutManagerActor = ray.remote(num_cpus=0)(RolloutManager)


def create_rollout_manager(args, bundles: Bundles, log_dir: str, engine_extra_args: list[str]):
    """Start the rollout manager actor (on the rollout bundles' node) and its engines + router."""
    strategy = (
        PlacementGroupSchedulingStrategy(
            placement_group=bundles.group, placement_group_bundle_index=bundles.indices[0]
        )
        if bundles.indices
        else None
    )
    manager = RolloutManagerActor.options(scheduling_strategy=strategy).remote(
        args, log_dir, engine_extra_args
    )
    ray.get(manager.start.remote())
    return manager
