"""The rollout manager as a Ray actor (a thin shell over ``vime.rollout.rollout_manager.RolloutManager``)."""

from __future__ import annotations

import logging

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime.backends.vllm_utils.engine_fleet import EngineLauncher
from vime.backends.vllm_utils.external_engines import external_engines
from vime.ray.engine_actor import NodeEngines
from vime.ray.placement_group import Bundles, BundleSlot, engine_placements
from vime.ray.rollout_batch import RolloutBatch, make_batch
from vime.ray.train_group import RayTrainGroup
from vime.ray.weight_update import WeightUpdate
from vime.rollout.rollout_manager import RolloutManager
from vime.utils.vllm_config import engine_specs, serving_config

LOG_NAME = "rollout_manager.log"


class RayRolloutManager(RolloutManager):
    """The rollout manager in its Ray actor: rollouts leave it by reference (:mod:`vime.ray.rollout_batch`). Its
    log (engine replacements, sync retries, router restarts) goes to ``rollout_manager.log`` in the run's log
    directory: the driver does not print its actors' output."""

    def __init__(self, args, log_dir: str, engine_extra_args: list[str], launcher: EngineLauncher):
        super().__init__(args, log_dir, engine_extra_args, launcher)
        handler = logging.FileHandler(self.log_dir / LOG_NAME)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        vime_logger = logging.getLogger("vime")
        vime_logger.addHandler(handler)
        vime_logger.setLevel(logging.INFO)

    def generate_batch(
        self, rollout_id: int, dp_sizes: tuple[int, ...], weights_ahead: bool = False
    ) -> RolloutBatch:
        """Rollout ``rollout_id``, split for training groups of the given data-parallel sizes (``weights_ahead``:
        see :meth:`RolloutManager.generate`)."""
        return make_batch(self.args, self.generate(rollout_id, weights_ahead), dp_sizes)

    def attach_trainers(self, actor: RayTrainGroup, critic: RayTrainGroup | None) -> None:
        """The training groups whose weights :meth:`update_weights` pushes (the actor's; the critic is offloaded
        with it under ``--offload-train``)."""
        self.weight_update = WeightUpdate(self, actor, critic)

    # Its own thread (the "fault" concurrency group): a push to stranded replacements runs during a rollout.
    @ray.method(concurrency_group="fault")
    def update_weights(
        self, stranded: bool = False, rollout_weights: bool = False, new_version: bool = True
    ) -> tuple[int, dict[str, float]]:
        """A weight update in one call: see :meth:`vime.ray.weight_update.WeightUpdate.update`."""
        return self.weight_update.update(stranded, rollout_weights, new_version)

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
        placements = engine_placements(args, bundles, slots, sizes, keep_order=args.colocate)
        launcher = NodeEngines(placements, session=args.rollout_session_id)
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
        kept = f", kept by session {args.rollout_session_id}" if where["runs"] > 1 else ""
        print(
            f"[vime] engine {slot} ({where['model']}): {where['url']} on node {where['node_id']} ({where['node_ip']}), "
            f"server pid {where['server_pid']} (owned by actor pid {where['actor_pid']}{kept})",
            flush=True,
        )
    return manager
