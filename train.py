"""vime's synchronous RL loop (DESIGN.md §4). Today: the rollout side (``--debug-rollout-only``).

The trainer side (Ray placement, FSDP2/Megatron actor, weight sync) lands with the loop issue; until then a
run without ``--debug-rollout-only`` stops with a message saying so.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from vime.rollout.rollout_manager import RolloutManager
from vime.utils.arguments import parse_args


def main(args) -> None:
    if not args.debug_rollout_only:
        raise SystemExit(
            "train.py: the training loop (trainer, weight sync) is not implemented yet; "
            "run with --debug-rollout-only to exercise engines, router, rollout, rewards and eval"
        )
    log_dir = Path(args.log_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    manager = RolloutManager(args, log_dir)
    try:
        manager.start()
        if args.num_rollout is None:
            args.num_rollout = args.num_epoch * manager.data_source.num_rollout_per_epoch
            if not args.num_rollout:
                raise SystemExit(
                    f"--num-epoch {args.num_epoch}: the {len(manager.data_source.dataset)} prompts make no full "
                    f"batch of --rollout-batch-size {args.rollout_batch_size}; lower it or use --num-rollout"
                )
        for rollout_id in range(args.num_rollout):
            if args.eval_interval and rollout_id % args.eval_interval == 0:
                print(f"[eval {rollout_id}] {manager.eval(rollout_id).metrics}")
            output = manager.generate(rollout_id)
            metrics = output.metrics or {}
            print(
                f"[rollout {rollout_id}] reward {metrics.get('rollout/reward_mean', float('nan')):.3f} "
                f"len {metrics.get('rollout/response_length_mean', float('nan')):.1f} "
                f"time {metrics.get('rollout/time_s', float('nan')):.1f}s"
            )
            if args.save and args.save_interval and (rollout_id + 1) % args.save_interval == 0:
                manager.save(rollout_id, args.save)
    finally:
        manager.shutdown()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    main(parse_args())
