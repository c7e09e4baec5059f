"""A weight update as one call: the choreography around the weight-sync protocol (DESIGN.md §5), run by the rollout
manager's actor, which owns the engines and holds the training groups' handles (``RolloutManagerActor.update_weights``).

The manager drives, not the trainers: most steps are the manager's own (wake the engines, the rollout functions'
hooks, engine health and URLs, the engines' side of the weight check, the version and re-admitting replacements);
the trainers' steps (push the weights, score the check sequence, offload) are calls to their groups.
A sync between loop steps, its retry when an engine dies during it, and a push to replacement engines stranded in
the middle of a rollout all go through :meth:`WeightUpdate.update`, weight check included.
"""

from __future__ import annotations

import logging
import time

import ray

from vime.backends.vllm_utils.control_client import EngineGroup
from vime.backends.vllm_utils.external_engines import served_dtype
from vime.ray.train_group import RayTrainGroup
from vime.rollout.rollout_manager import RolloutManager
from vime.utils import weight_check

logger = logging.getLogger(__name__)


class WeightUpdate:
    """Pushes the actor group's weights to the manager's engines (``critic``: offloaded with the actor under
    ``--offload-train``)."""

    def __init__(self, manager: RolloutManager, actor: RayTrainGroup, critic: RayTrainGroup | None):
        self.manager, self.actor, self.critic = manager, actor, critic
        self.args = manager.args
        self.sync_dir = self.args.update_weight_dir or str(manager.log_dir / "weight_sync")
        # the engines' checksums at the last checked version (weight_check.compare_checksums's reference)
        self.checked: tuple[int, dict] = (-1, {})

    def update(
        self, stranded: bool = False, rollout_weights: bool = False, new_version: bool = True
    ) -> tuple[int, dict[str, float]]:
        """Push weights to the engines; the weight version they serve then, and the sync's metrics. The version is
        the run context's: one more than the engines' with ``new_version`` (the actor's weights, trained since), else
        theirs (``stranded`` replacements get what the other engines served).

        By default every live engine gets the actor's weights, between loop steps: wake the engines' weights
        (``--offload-rollout``), the rollout functions' ``before_weight_update``, push (with
        ``--use-fault-tolerance`` dead engines are replaced first, and a sync an engine died in is done again over
        the engines as they are then, once: ``fault/sync_retries``), score the check sequence on the trainer, offload
        the trainers (``--offload-train``), wake the KV cache, check the engines (their checksums and log-probs:
        ``weight_sync/check_abs_diff``; its cost: ``weight_sync/checksum_s`` in the push, ``check_trainer_s`` and
        ``check_s``),
        record the version and admit the replacements it reached, ``after_weight_update``.

        ``stranded``: only the replacement engines waiting for weights when no engine is left to serve a rollout
        (nothing, and no metrics, when there are none), during that rollout; ``rollout_weights``: push the weights
        that rollout is generated with (``--keep-old-actor``'s kept copy) instead of the actor's."""
        started = time.monotonic()
        version = self.manager.run_context.weight_version + int(new_version)
        urls = self.manager.stranded_engines() if stranded else None
        if stranded and not urls:
            return self.manager.run_context.weight_version, {}
        self.manager.wake_up(["weights"])  # a no-op unless the engines sleep
        woken = time.monotonic()
        self.manager.before_weight_update()
        if urls is None:
            metrics, expected, urls = self._push_to_all(version, started)
            metrics |= self._offload_trainers()  # after the push and the check: they read the actor's weights
            kv_woken = time.monotonic()
            self.manager.wake_up(["kv_cache"])
            metrics["weight_sync/kv_cache_wake_s"] = time.monotonic() - kv_woken
        else:
            metrics, expected = self._push(urls, version, rollout_weights, started)
        metrics["weight_sync/weights_wake_s"] = woken - started
        if expected is not None:
            checked = time.monotonic()
            metrics["weight_sync/check_abs_diff"] = self.check_engines(urls, expected, version)
            metrics["weight_sync/check_s"] = time.monotonic() - checked
        self.manager.set_weight_version(version, urls)
        return version, metrics | {"time/sync_s": time.monotonic() - started}

    def _push(
        self, urls: list[str], version: int, rollout_weights: bool, started: float
    ) -> tuple[dict[str, float], list[float] | None]:
        """Push to ``urls``; the metrics (but for ``rollout_weights``, ``weight_sync/wake_to_resume_s``: from
        ``started``, the sync's first wake call, until the engines resumed) and, with
        ``--check-weight-update-equal``, the trainer's scores of the check sequence with the weights pushed (taken
        before they may leave the GPU)."""
        tokens = (
            weight_check.check_tokens(self.args.hf_checkpoint)
            if self.args.check_weight_update_equal
            else None
        )
        with self.manager.control():
            if rollout_weights:
                return self.actor.push_rollout_weights(urls, version, self.sync_dir, tokens)
            metrics = self.actor.sync_weights(urls, version, self.sync_dir)
        metrics["weight_sync/wake_to_resume_s"] = time.monotonic() - started
        if tokens is None:
            return metrics, None
        scoring = time.monotonic()
        expected = self.actor.sequence_log_probs(tokens)
        return metrics | {"weight_sync/check_trainer_s": time.monotonic() - scoring}, expected

    def _push_to_all(
        self, version: int, started: float
    ) -> tuple[dict[str, float], list[float] | None, list[str]]:
        """:meth:`_push` to every live engine, with ``--use-fault-tolerance``'s replacement and one retry; also
        returns the engines reached."""

        def push() -> tuple[dict[str, float], list[float] | None, list[str]]:
            self.manager.ensure_engines_healthy()  # a no-op without --use-fault-tolerance
            urls = self.manager.engine_urls()
            # every engine died and none of their replacements is up yet: they get the weights once stranded
            if not urls:
                logger.warning("weight sync %d: no engine is up to receive it", version)
                return {"weight_sync/engines": 0.0}, None, urls
            return *self._push(urls, version, False, started), urls

        if not self.args.use_fault_tolerance:
            return push()
        retries = 0.0
        try:
            metrics, expected, urls = push()
        except ray.exceptions.RayTaskError as e:
            if "EngineControlError" not in str(e):
                raise
            logger.warning("weight sync %d lost an engine; replacing it and syncing again", version)
            retries = 1.0
            metrics, expected, urls = push()
        return metrics | {"fault/sync_retries": retries}, expected, urls

    def _offload_trainers(self) -> dict[str, float]:
        """``--offload-train``: free the actor's (and critic's) GPU memory for the engines; the actor's figures."""
        if not self.args.offload_train:
            return {}
        if self.critic is not None:
            self.critic.offload()
        return self.actor.offload()

    def check_engines(self, urls: list[str], expected: list[float], version: int) -> float:
        """The weights check (:mod:`vime.utils.weight_check`) of the engines at ``urls``, asked directly (not through
        the router): their parameters' checksums against those recorded when they loaded ``version`` and against each
        other's, then the check sequence's log-probs against the trainer's (``expected``). Returns the largest mean
        log-prob difference; ``RuntimeError`` naming the engines that fail."""
        tokens = weight_check.check_tokens(self.args.hf_checkpoint)
        with EngineGroup(urls) as engines:
            reports = engines.run(lambda engine: engine.collective_rpc("check_weights_checksums"))
            reference = self.checked[1] if self.checked[0] == version else None
            reference = weight_check.compare_checksums(
                dict(zip(urls, reports, strict=True)), version, reference
            )
            scores = engines.run(lambda engine: engine.prompt_log_probs(self.args.hf_checkpoint, tokens))
        # engines vime started run --vllm-dtype; attached ones say what they run
        engine_dtype = served_dtype(urls[0]) if self.args.rollout_external_engine_addrs and urls else None
        tol = weight_check.tolerance(self.args, engine_dtype)
        diff = weight_check.compare(expected, dict(zip(urls, scores, strict=True)), tol, version)
        self.checked = (version, reference)
        return diff
