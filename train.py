"""vime's synchronous RL loop (DESIGN.md §4): generate, train, save, push weights, evaluate."""

from __future__ import annotations

import logging
import time

from vime.ray.run import start_run
from vime.utils.arguments import parse_args


def main(args) -> None:
    if args.keep_old_actor:
        raise SystemExit(
            "--keep-old-actor scores old log-probs with the weights of the sync before the last one, for "
            "train_async.py (its trainer is a step ahead of the rollout it trains on); train.py trains every rollout "
            "on the weights that generated it: drop the flag"
        )
    run = start_run(args)
    with run:  # closed at the end; a failure keeps a --rollout-session-id's engines serving
        for rollout_id in range(run.start_rollout_id, run.num_rollout):
            if run.should_eval(rollout_id):
                run.evaluate(rollout_id)
            started = time.monotonic()
            batch = run.wait_rollout(run.generate(rollout_id))
            metrics = {**batch.metrics, "time/rollout_s": time.monotonic() - started}
            metrics |= run.train(rollout_id, batch)
            if run.should_save(rollout_id):
                run.save(rollout_id)
            metrics |= run.sync_weights()
            run.tracker.log(rollout_id, metrics)
        if run.should_eval(run.num_rollout):
            run.evaluate(run.num_rollout)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    main(parse_args())
