"""The rollout manager as a Ray actor (a thin shell over ``vime.rollout.rollout_manager.RolloutManager``)."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime.backends.vllm_utils.external_engines import external_engines
from vime.ray.engine_actor import NodeEngines
from vime.ray.placement_group import Bundles, BundleSlot, engine_placements
from vime.ray.rollout_batch import RolloutBatch, make_batch
from vime.rollout.rollout_manager import RolloutManager
from vime.utils.vllm_config import engine_specs, serving_config


class RayRolloutManager(RolloutManager):
    """The rollout manager in its Ray actor: rollouts leave it by reference (:mod:`vime.ray.rollout_batch`)."""

    def generate_batch(
        self, rollout_id: int, dp_sizes: tuple[int, ...], train_version: int | None = None
    ) -> RolloutBatch:
        """Rollout ``rollout_id``, split for training groups of the given data-parallel sizes (``train_version``:
        see :meth:`RolloutManager.generate`)."""
        return make_batch(self.args, self.generate(rollout_id, train_version), dp_sizes)

    # Answered while a rollout runs (their own thread: the "fault" concurrency group).
    @ray.method(concurrency_group="fault")
    def stranded_engines(self) -> list[str]:
        """``--use-fault-tolerance``: the replacement engines waiting for weights when no engine is left to serve.
        Raises the monitor's error once it has given up (an engine past ``--rollout-max-engine-restarts``), so a
        rollout left without engines stops the run then instead of retrying its requests for the replacement window."""
        if self.monitor is None:
            return []
        self.monitor.raise_if_fatal()
        return self.monitor.stranded()

    @ray.method(concurrency_group="fault")
    def admit_engines(self, urls: list[str], version: int) -> None:
        """Replacements pushed weight version ``version`` outside a sync (the rollout's only engines now) rejoin
        the router; new samples are stamped with that version."""
        self.args.weight_version = version
        self.monitor.admit_synced(urls)

    def describe_engines(self) -> list[dict]:
        """Where each engine runs (``NodeEngine.where``, and the model it serves), in slot order."""
        engines = self.engines + [
            engine for model_engines, _ in self.frozen.values() for engine in model_engines
        ]
        if not engines:  # --debug-train-only / --load-debug-rollout-data start none
            return []
        if self.args.rollout_external_engine_addrs:
            return [
                {"url": engine.url, "model": spec.model, "external": True}
                for engine, spec in zip(engines, self.specs, strict=True)
            ]
        places = ray.get([engine.actor.where.remote() for engine in engines])
        return [place | {"model": spec.model} for place, spec in zip(places, self.specs, strict=True)]


# Engines run on their bundles' nodes, each owned by its own actor (vime.ray.engine_actor).
RolloutManagerActor = ray.remote(num_cpus=0, concurrency_groups={"fault": 1})(RayRolloutManager)


def create_rollout_manager(
    args,
    bundles: Bundles,
    log_dir: str,
    engine_extra_args: list[str],
    slots: list[BundleSlot],
):
    """Start the rollout manager actor (on the first rollout bundle's node) and its engines + router. ``slots``
    are the rollout bundles' nodes and GPUs (:func:`~vime.ray.placement_group.bundle_slots`, or the colocated
    actor ranks')."""
    strategy = (
        PlacementGroupSchedulingStrategy(
            placement_group=bundles.group, placement_group_bundle_index=bundles.indices[0]
        )
        if bundles.indices
        else None
    )
    if args.rollout_external_engine_addrs:
        launcher = external_engines(args)
    else:
        sizes = (
            [] if args.debug_train_only else [spec.num_gpus for spec in engine_specs(serving_config(args))]
        )
        launcher = NodeEngines(engine_placements(args, bundles, slots, sizes, keep_order=args.colocate))
    manager = RolloutManagerActor.options(scheduling_strategy=strategy).remote(
        args, log_dir, engine_extra_args, launcher
    )
    ray.get(manager.start.remote())
    for slot, where in enumerate(ray.get(manager.describe_engines.remote())):
        if where.get("external"):
            print(
                f"[vime] engine {slot} ({where['model']}): {where['url']}, external (left running at exit)",
                flush=True,
            )
            continue
        print(
            f"[vime] engine {slot} ({where['model']}): {where['url']} on node {where['node_id']} ({where['node_ip']}), "
            f"server pid {where['server_pid']} (owned by actor pid {where['actor_pid']})",
            flush=True,
        )
    return manager
