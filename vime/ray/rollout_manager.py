"""The rollout manager as a Ray actor (a thin shell over ``vime.rollout.rollout_manager.RolloutManager``)."""

from __future__ import annotations

import os

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime.ray.placement_group import Bundles
from vime.ray.rollout_batch import RolloutBatch, make_batch
from vime.rollout.rollout_manager import RolloutManager


class RayRolloutManager(RolloutManager):
    """The rollout manager in its Ray actor: rollouts leave it by reference (:mod:`vime.ray.rollout_batch`)."""

    def generate_batch(
        self, rollout_id: int, dp_sizes: tuple[int, ...], train_version: int | None = None
    ) -> RolloutBatch:
        """Rollout ``rollout_id``, split for training groups of the given data-parallel sizes (``train_version``:
        see :meth:`RolloutManager.generate`)."""
        return make_batch(self.args, self.generate(rollout_id, train_version), dp_sizes)


# Engines run as subprocesses of this actor, on its node, each pinned to its bundles' GPUs.
RolloutManagerActor = ray.remote(num_cpus=0)(RayRolloutManager)


@ray.remote(num_cpus=0, num_gpus=1)
def _bundle_gpu() -> tuple[str, str]:
    """(node id, CUDA_VISIBLE_DEVICES) that Ray gives a task holding this bundle's GPU."""
    return ray.get_runtime_context().get_node_id(), os.environ["CUDA_VISIBLE_DEVICES"]


def bundle_gpus(bundles: Bundles) -> list[tuple[str, str]]:
    """(node id, GPU id) of each free GPU bundle, asked of Ray by a short task placed in it."""
    return ray.get(
        [
            _bundle_gpu.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=bundles.group, placement_group_bundle_index=index
                )
            ).remote()
            for index in bundles.indices
        ]
    )


def engine_gpus(args, gpus: list[tuple[str, str]]) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` of each engine: ``--rollout-num-gpus-per-engine`` consecutive GPUs, all on one
    node (the manager's: engines are its subprocesses)."""
    per_engine = args.rollout_num_gpus_per_engine
    nodes = {node for node, _ in gpus}
    if len(nodes) > 1:
        raise NotImplementedError(
            f"the rollout GPUs span {len(nodes)} Ray nodes; vime launches engines on one node so far"
        )
    ids = [gpu for _, gpu in gpus]
    return [",".join(ids[i : i + per_engine]) for i in range(0, len(ids), per_engine)]


def create_rollout_manager(
    args,
    bundles: Bundles,
    log_dir: str,
    engine_extra_args: list[str],
    gpus: list[tuple[str, str]] | None = None,
):
    """Start the rollout manager actor (on the rollout bundles' node) and its engines + router. ``gpus`` are the
    rollout's (node id, GPU id) pairs when the run has GPUs (:func:`bundle_gpus`, or the colocated actor's)."""
    strategy = (
        PlacementGroupSchedulingStrategy(
            placement_group=bundles.group, placement_group_bundle_index=bundles.indices[0]
        )
        if bundles.indices
        else None
    )
    manager = RolloutManagerActor.options(scheduling_strategy=strategy).remote(
        args, log_dir, engine_extra_args, engine_gpus(args, gpus) if gpus else None
    )
    ray.get(manager.start.remote())
    return manager
