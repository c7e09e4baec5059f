"""vime's synchronous RL loop (DESIGN.md §4): generate, train, save, push weights, evaluate."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import ray

from vime.ray.placement_group import create_placement_groups
from vime.ray.rollout_manager import create_rollout_manager
from vime.ray.train_group import RayTrainGroup
from vime.utils.arguments import parse_args
from vime.utils.tracking import Tracker

WORKER_EXTENSION = ["--worker-extension-cls", "vime.backends.vllm_utils.worker_extension.VimeWorkerExtension"]


def run_dir(args) -> Path:
    return Path(
        args.log_dir or (Path(args.save) / "logs" if args.save else f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    )


def main(args) -> None:
    # "local": always a fresh instance, never a stale cluster a previous `ray start` left registered in /tmp/ray.
    address = os.environ.get("RAY_ADDRESS") or "local"
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    log_dir = run_dir(args)
    tracker = Tracker(args, log_dir)
    pgs = create_placement_groups(args)
    manager = create_rollout_manager(args, pgs["rollout"], str(log_dir), WORKER_EXTENSION)
    try:
        actor = None if args.debug_rollout_only else RayTrainGroup(args, pgs["actor"])
        last = actor.load() if actor else None
        start_rollout_id = 0 if last is None else last + 1
        if last is not None:
            ray.get(manager.load.remote(last, args.load))
        args.num_rollout = num_rollout = args.num_rollout or args.num_epoch * ray.get(
            manager.num_rollout_per_epoch.remote()
        )
        weight_version = 0
        sync_dir = args.update_weight_dir or str(log_dir / "weight_sync")  # used by the disk transport
        engine_urls = ray.get(manager.engine_urls.remote())
        if actor:
            weight_version += 1
            actor.sync_weights(engine_urls, weight_version, sync_dir)
            ray.get(manager.set_weight_version.remote(weight_version))
        for rollout_id in range(start_rollout_id, num_rollout):
            if args.eval_interval and rollout_id % args.eval_interval == 0:
                tracker.log_eval(rollout_id, ray.get(manager.eval.remote(rollout_id)).metrics)
            started = time.monotonic()
            output = ray.get(manager.generate.remote(rollout_id))
            metrics = {**(output.metrics or {}), "time/rollout_s": time.monotonic() - started}
            if actor:
                started = time.monotonic()
                metrics |= {f"train/{k}": v for k, v in actor.train(rollout_id, output.samples).items()}
                metrics["time/train_s"] = time.monotonic() - started
            if args.save and args.save_interval and (rollout_id + 1) % args.save_interval == 0:
                if actor:
                    actor.save(rollout_id, args.save)
                ray.get(manager.save.remote(rollout_id, args.save))
            if actor:
                started = time.monotonic()
                weight_version += 1
                metrics |= actor.sync_weights(engine_urls, weight_version, sync_dir)
                ray.get(manager.set_weight_version.remote(weight_version))
                metrics["time/sync_s"] = time.monotonic() - started
            tracker.log(rollout_id, metrics)
        if args.eval_interval:
            tracker.log_eval(num_rollout, ray.get(manager.eval.remote(num_rollout)).metrics)
    finally:
        ray.get(manager.shutdown.remote())
        tracker.close()
        ray.shutdown()
    print(
        f"[vime] metrics: {log_dir / 'metrics.jsonl'}" + (f" | checkpoints: {args.save}" if args.save else "")
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    main(parse_args())
