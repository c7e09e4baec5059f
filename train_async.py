"""vime's one-step off-policy loop: rollout k+1 is generated while the trainer learns from rollout k.

Weights reach the engines every ``--update-weights-interval`` rollouts, always between two rollouts (the
in-flight one is finished first), so with the default rollout every sample of a batch comes from one policy
version. The fully-async rollout (``vime.rollout.fully_async_rollout``) keeps generating across syncs instead,
within ``--max-staleness``.
"""

from __future__ import annotations

import logging
import time

from vime.ray.run import start_run
from vime.utils.arguments import parse_args


def main(args) -> None:
    if args.colocate or args.offload_rollout or args.offload_train:
        raise SystemExit(
            "train_async.py overlaps rollout and training on separate resources: drop --colocate, "
            "--offload-rollout and --offload-train (neither side can give its GPUs up while the other works)"
        )
    run = start_run(args)
    with run:  # closed at the end; a failure keeps a --rollout-session-id's engines serving
        next_rollout = run.generate(run.start_rollout_id)
        for rollout_id in range(run.start_rollout_id, run.num_rollout):
            if run.should_eval(rollout_id):
                run.evaluate(rollout_id)
            step_started = time.monotonic()
            batch = run.wait_rollout(next_rollout)
            metrics = {**batch.metrics, "time/rollout_wait_s": time.monotonic() - step_started}
            next_rollout = None
            if rollout_id + 1 < run.num_rollout:  # trained after this step's weight push, if there is one
                pushed = (rollout_id + 1) % args.update_weights_interval == 0
                next_rollout = run.generate(rollout_id + 1, sync_before_train=pushed)
            metrics |= run.train(rollout_id, batch)
            if run.should_save(rollout_id):
                run.save(rollout_id)
            if (rollout_id + 1) % args.update_weights_interval == 0:
                if next_rollout is not None:
                    run.wait_rollout(next_rollout)  # never change weights in the middle of a rollout
                metrics |= run.sync_weights()
            run.tracker.log(rollout_id, {**metrics, "time/step_s": time.monotonic() - step_started})
        if run.should_eval(run.num_rollout):
            run.evaluate(run.num_rollout)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    main(parse_args())
