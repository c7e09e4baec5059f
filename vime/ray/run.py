"""One training run's moving parts, shared by ``train.py`` and ``train_async.py``: Ray, the rollout manager,
the actor (and critic) training groups, the tracker, checkpoints and weight sync (DESIGN.md §4)."""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray._private import ray_constants

from vime.backends.vllm_utils import control_auth
from vime.backends.vllm_utils.external_engines import WORKER_EXTENSION_CLS
from vime.ray import serving_session
from vime.ray.placement_group import bundle_slots, create_placement_groups, num_bundles
from vime.ray.rollout import create_rollout_manager
from vime.ray.rollout_batch import RolloutBatch
from vime.ray.train_group import RayTrainGroup
from vime.utils.arg_validation import check_run_paths
from vime.utils.reaper import start_reaper
from vime.utils.tracking import Tracker

WORKER_EXTENSION = ["--worker-extension-cls", WORKER_EXTENSION_CLS]
# Ray settings of a run's own local instance (and of the tests' clusters): vime's work runs in actors, so the task
# workers Ray would prestart for the first driver would only sit idle, each having imported Ray (~1.5-3 CPU-s)
RAY_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}


def run_dir(args: argparse.Namespace) -> Path:
    """``--log-dir``, else ``--save``/logs, else ``runs/<timestamp>``."""
    return Path(
        args.log_dir or (Path(args.save) / "logs" if args.save else f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    )


def init_ray(args: argparse.Namespace) -> None:
    """Join the cluster at ``RAY_ADDRESS``, else start a fresh local instance (never a stale cluster that a
    previous ``ray start`` left registered in /tmp/ray). Locally, CPU bundles may outnumber the cores: the
    engines and ranks then share them, which is what a CPU run does anyway.

    A local instance is the run's own: it listens on loopback only (so do the engines and training stores, which
    use Ray's node address) and dies with the driver, even a SIGKILLed one (:mod:`vime.utils.reaper`).

    ``ray start`` (Ray 2.60) turns on token authentication; a driver given an explicit address sends the token
    only with ``RAY_AUTH_MODE=token`` in its environment (Ray reads it at import, so it cannot be set here).

    ``--rollout-session-id`` needs the cluster (its engines outlive this driver) and joins it in the sessions'
    namespace; a session that already has engines lends this run their control secret (:mod:`.serving_session`)."""
    session = args.rollout_session_id
    if address := os.environ.get("RAY_ADDRESS"):
        namespace = serving_session.NAMESPACE if session else None
        _join(address, namespace)
        secret = serving_session.session_secret(session) if session else None
        if secret is not None and secret != control_auth.run_secret():
            ray.shutdown()  # the engines' secret reaches this run's actors only at ray.init
            os.environ[control_auth.SECRET_ENV] = secret
            _join(address, namespace)
        return
    if session:
        raise ValueError(
            f"--rollout-session-id {session} keeps the engines on a Ray cluster that outlives this driver: start one "
            "(ray start --head) and set RAY_ADDRESS (with RAY_AUTH_MODE=token), or drop the flag"
        )
    runtime_env = {
        "env_vars": {control_auth.SECRET_ENV: control_auth.run_secret()}
    }  # engines' control secret
    # Ray takes the machine's outward address as the node's, and binds its servers to every interface, unless
    # that address is loopback, which it gives only where it runs without clusters (its Windows/macOS switch).
    ray_constants.ENABLE_RAY_CLUSTER = False
    # ray.init (2.60) starts the dashboard head, log monitor and autoscaler monitor (and the raylet both agents)
    # whatever its arguments, system config or RAY_* variables: ~2.5 CPU-s a start with bytecode caches, ~6.3 without
    # (bench/ray_startup_cost.py)
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, num_bundles(args)),
        log_to_driver=False,
        include_dashboard=False,
        runtime_env=runtime_env,
        _system_config=RAY_SYSTEM_CONFIG,
    )
    start_reaper()


def _join(address: str, namespace: str | None) -> None:
    """Connect to the cluster at ``address``, this run's actors inheriting its control secret."""
    runtime_env = {"env_vars": {control_auth.SECRET_ENV: control_auth.run_secret()}}
    ray.init(address=address, namespace=namespace, log_to_driver=False, runtime_env=runtime_env)


@dataclass
class Run:
    """The started parts of a run; each method is one step of the loop."""

    args: argparse.Namespace
    manager: ray.actor.ActorHandle
    actor: RayTrainGroup | None
    critic: RayTrainGroup | None
    tracker: Tracker
    log_dir: Path
    start_rollout_id: int
    num_rollout: int  # --num-rollout, or --num-epoch passes over the prompts
    trained_since_sync: bool = False  # the actor's weights are ahead of the engines' version (train_async.py)

    @property
    def has_engines(self) -> bool:
        return not self.args.debug_train_only

    @property
    def syncs_weights(self) -> bool:
        return self.actor is not None and self.has_engines

    def generate(self, rollout_id: int, sync_before_train: bool = False) -> ray.ObjectRef:
        """Submit rollout ``rollout_id`` to the manager; returns its future (a :class:`RolloutBatch`: metrics and
        references to every training rank's share, which never pass through this process).
        ``sync_before_train``: the loop pushes new weights between generating this rollout and training on it
        (train_async.py), so it trains on one weight version more than the engines serve now."""
        dp_sizes = tuple(group.dp_size for group in (self.actor, self.critic) if group is not None)
        return self.manager.generate_batch.remote(
            rollout_id, dp_sizes, sync_before_train and self.syncs_weights
        )

    def wait_rollout(self, rollout: ray.ObjectRef) -> RolloutBatch:
        """Wait for a rollout from :meth:`generate`. With ``--use-fault-tolerance``, meanwhile: once no engine is
        left to serve (each is a replacement waiting for weights, as after the death of a run's only engine), the
        replacements get weights now, since the sync after this rollout would never come: the version the rollout
        is generated with. When the actor has trained since the last sync (train_async.py), that version is the copy
        ``--keep-old-actor`` keeps; without the flag the replacements get the actor's weights as the next version
        (the old log-probs then come from the actor anyway)."""
        if self.args.use_fault_tolerance and self.syncs_weights:
            while not ray.wait([rollout], timeout=self.args.rollout_health_check_interval)[0]:
                self._serve_stranded()
        return ray.get(rollout)

    def _serve_stranded(self) -> None:
        """Push the rollout's weights to the stranded replacements, if any (the same call as a sync: checked, then
        admitted)."""
        kept = self.trained_since_sync and self.args.keep_old_actor
        new_version = self.trained_since_sync and not kept
        version, metrics = ray.get(
            self.manager.update_weights.remote(stranded=True, rollout_weights=kept, new_version=new_version)
        )
        if metrics:
            print(
                f"[vime] no engine was left to serve the rollout: the replacements got weight version {version}"
            )
            self.trained_since_sync = kept

    def train(self, rollout_id: int, batch: RolloutBatch) -> dict[str, float]:
        """Train the critic (ppo) and, after ``--num-critic-only-steps``, the actor on one rollout."""
        if self.actor is None:
            return {}
        started = time.monotonic()
        if self.args.offload_rollout and self.has_engines:  # colocated: the engines give the GPUs back
            ray.get(self.manager.sleep.remote())
        metrics: dict[str, float] = self.onload_trainers()  # the sync offloads them (WeightUpdate)
        actor_inputs, critic_futures = {}, []
        if self.critic is not None:
            values = self.critic.compute("values", batch)
            actor_inputs["values"] = self.actor.for_me(values, batch, self.critic.dp_size)
            critic_inputs = {"values": values}
            if self.args.kl_coef:  # the critic's returns include the KL penalty, from the actor's log-probs
                for kind in ("log_probs", "ref_log_probs"):
                    computed = self.actor.compute(kind, batch)
                    actor_inputs[kind] = computed
                    critic_inputs[kind] = self.critic.for_me(computed, batch, self.actor.dp_size)
            critic_futures = self.critic.train_async(rollout_id, batch, **critic_inputs)
        if rollout_id >= self.args.num_critic_only_steps:
            metrics |= {
                f"train/{k}": v for k, v in self.actor.train(rollout_id, batch, **actor_inputs).items()
            }
            self.trained_since_sync = True
        if critic_futures:
            metrics |= {f"critic/{k}": v for k, v in ray.get(critic_futures)[0].items()}
        metrics["time/train_s"] = time.monotonic() - started
        return metrics

    def onload_trainers(self) -> dict[str, float]:
        """``--offload-train``: bring the actor's (and critic's) training state back to the GPUs."""
        if not self.args.offload_train:
            return {}
        metrics = self.actor.onload() if self.actor is not None else {}
        if self.critic is not None:
            self.critic.onload()
        return metrics

    def save(self, rollout_id: int) -> None:
        """Checkpoint the actor, the critic (``--critic-save``) and the data buffer at ``rollout_id`` (``--save``);
        with ``--save-hf`` export the actor as a Hugging Face directory (with or without ``--save``). The
        checkpoints are declared complete (their ``latest_checkpointed_iteration.txt``) only once all of them and
        the data buffer are written, the actor's last: a run killed in between resumes from the previous one."""
        args = self.args
        written = []
        if self.actor is not None and args.save:
            self.actor.save(rollout_id, args.save, mark=False)
            written.append((self.actor, args.save))
        if self.critic is not None and args.critic_save:
            self.critic.save(rollout_id, args.critic_save, mark=False)
            written.insert(0, (self.critic, args.critic_save))
        if args.save:
            ray.get(self.manager.save.remote(rollout_id, args.save))
        for group, save_dir in written:
            group.mark_saved(rollout_id, save_dir)
        if self.actor is not None and args.save_hf:
            self.actor.export_hf(args.save_hf.format(rollout_id=rollout_id))

    def should_save(self, rollout_id: int) -> bool:
        args = self.args
        is_last = rollout_id + 1 == self.num_rollout
        return bool(args.save or args.save_hf) and (
            is_last or bool(args.save_interval and (rollout_id + 1) % args.save_interval == 0)
        )

    def should_eval(self, rollout_id: int) -> bool:
        """Every ``--eval-interval`` rollouts, including before the first step unless ``--skip-eval-before-train``."""
        if rollout_id == 0 and self.args.skip_eval_before_train:
            return False
        return (
            self.has_engines and bool(self.args.eval_interval) and rollout_id % self.args.eval_interval == 0
        )

    def evaluate(self, rollout_id: int) -> None:
        self.tracker.log_eval(rollout_id, ray.get(self.manager.eval.remote(rollout_id)).metrics)

    def sync_weights(self) -> dict[str, float]:
        """Push the actor's weights to every engine as the next weight version: one call to the rollout manager,
        which runs the sync (:mod:`vime.ray.weight_update`)."""
        if not self.syncs_weights:
            return {}
        self.trained_since_sync = False
        return ray.get(self.manager.update_weights.remote())[1]

    def close(self, failed: bool = False) -> None:
        """Stop engines and router, close the tracker, leave Ray (its actors go with it). ``failed`` with
        ``--rollout-session-id``: the engines stay up for a resubmitted run; after a run that ended normally they
        stop and the session's bundles are removed."""
        session = self.args.rollout_session_id
        keep = failed and session is not None
        try:
            ray.get(self.manager.shutdown.remote(keep_engines=keep))
            if session is not None and not keep:
                serving_session.release(session)
        finally:
            self.tracker.close()
            ray.shutdown()
        saved = f" | checkpoints: {self.args.save}" if self.args.save else ""
        print(f"[vime] metrics: {self.log_dir / 'metrics.jsonl'}{saved}", flush=True)
        if keep:
            print(
                f"[vime] the engines of --rollout-session-id {session} keep serving: resubmit with the same flags "
                "(and --load) to go on",
                flush=True,
            )

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        """Close the run; a failure keeps a ``--rollout-session-id``'s engines serving."""
        self.close(failed=exc_type is not None)


def first_rollout_id(args: argparse.Namespace, last_saved: int | None) -> int:
    """``--start-rollout-id`` if set, else the rollout after the loaded checkpoint's, else 0."""
    if args.start_rollout_id is not None:
        return args.start_rollout_id
    return 0 if last_saved is None else last_saved + 1


def _print_elapsed(what: str, started: float) -> None:
    """Start-up progress on the console: a slow start says which part was slow."""
    print(f"[vime] {what} {time.monotonic() - started:.0f} s after start", flush=True)


def start_run(args: argparse.Namespace) -> Run:
    """Start Ray, the engines + router, the training groups; resume from ``--load``; push the first weights."""
    check_run_paths(args)
    started = time.monotonic()
    init_ray(args)
    _print_elapsed("Ray up", started)
    log_dir = run_dir(args)
    pgs = create_placement_groups(args)
    actor = critic = manager = None
    try:
        if not args.debug_rollout_only:  # the ranks build their trainers while the engines start
            actor = RayTrainGroup(args, pgs["actor"])
            if pgs["critic"].indices:
                critic = RayTrainGroup(args, pgs["critic"], role="critic")
        groups = [group for group in (actor, critic) if group is not None]
        if args.colocate or args.offload_train:
            for group in groups:  # engines then start on the memory the trainers left (or freed)
                group.wait_ready()
            _print_elapsed("trainers built", started)
        if args.offload_train:
            if pgs["actor"].resource != "GPU":
                raise ValueError("--offload-train moves training state off GPUs: this run's trainer has none")
            for group in groups:
                group.offload()  # the engines find the GPU memory free when they start
        slots = []  # the rollout bundles' nodes and GPUs (a colocated engine shares its training rank's)
        if not args.debug_train_only:
            colocated = args.colocate and actor is not None
            slots = actor.slots()[: args.rollout_num_gpus] if colocated else bundle_slots(pgs["rollout"])
        manager = create_rollout_manager(args, pgs["rollout"], str(log_dir), WORKER_EXTENSION, slots)
        _print_elapsed("engines and router up", started)
        for group in groups:
            group.wait_ready()
        _print_elapsed("trainers ready", started)
        if args.offload_train:
            if args.offload_rollout and not args.debug_train_only:
                ray.get(manager.sleep.remote())  # the first weight sync wakes them
            for group in groups:
                group.onload()
        last = actor.load() if actor else None
        if critic is not None:
            critic.load()
        if last is not None:
            ray.get(manager.load.remote(last, args.load))
            _print_elapsed(f"checkpoint of rollout {last} loaded", started)
        num_rollout = args.num_rollout or args.num_epoch * ray.get(manager.num_rollout_per_epoch.remote())
        start = (
            args.start_rollout_id if args.start_rollout_id is not None else 0 if last is None else last + 1
        )
        if actor is not None:
            ray.get(manager.attach_trainers.remote(actor, critic))
        tracker = Tracker(args, log_dir, num_rollout)
        run = Run(args, manager, actor, critic, tracker, log_dir, start, num_rollout)
        run.sync_weights()
        _print_elapsed("first weight sync done", started)
        return run
    except BaseException:
        if manager is not None:  # a session's engines stay up for the next try
            ray.get(manager.shutdown.remote(keep_engines=args.rollout_session_id is not None))
        ray.shutdown()
        raise
