"""Fully-async rollout (slime's ``fully_async`` example) with a staleness bound: generation never stops.

``--rollout-function-path vime.rollout.fully_async_rollout.generate_rollout`` (or slime's name,
``generate_rollout_fully_async``) names :class:`FullyAsyncRollout`, a rollout function with state: the rollout
manager makes it once and calls it like a function, and it takes part in weight syncs, checkpoints and shutdown
through the lifecycle hooks any rollout function may define (:mod:`vime.rollout.lifecycle`). The first call starts
a worker on the rollout manager's event loop (:mod:`vime.utils.async_utils`) that from then on keeps groups in
flight through the router, across rollout boundaries and weight syncs; each call returns the next
``--rollout-batch-size`` finished groups as soon as they are there. Groups go through the same ``generate_group``
as the default rollout (custom generate function, rewards, sample hooks), then the dynamic-sampling filter; slime's
batch hooks run on each returned batch.

**Staleness.** Every sample records the weight version of each request that generated it (``weight_versions``,
read when the request is sent). Its lag is ``T - min(weight_versions)``, ``T`` being the version the trainer holds
when it trains the batch (the run context's ``train_weight_version``: the engines' version, or one more when
``train_async.py`` pushes weights between generating a rollout and training on it). A group with a sample lagging
more than ``--max-staleness`` is not trained: its prompts go back to the data buffer to be generated again
(``fully_async/regenerated_groups``), so no trained sample exceeds the bound. To waste little, the worker starts a
group only while it would still be trained within the bound (rollouts are served in order, one weight version at
most per rollout), and never more than ``--rollout-concurrency`` x engines groups at once.

**Weight syncs.** Engines pause in place during a sync (DESIGN.md §5), so requests in flight finish on the new
weights and keep the older stamp (conservative). With ``--flush-cache-interval`` (:mod:`vime.utils.inflight`) each
sample records the version that sampled each token instead (``weight_version_spans``; ``weight_versions`` lists them
all, so the lag still counts from the oldest), and a sync that is a full refresh aborts the requests in flight: their
groups go back to the data buffer (``fully_async/aborted_groups``). Between the ``before_weight_update`` and
``after_weight_update`` hooks the worker starts no request, so no new request is stamped with a version it will not
run on. The worker never pauses or aborts engines itself.

**Checkpoints.** Groups drawn from the data buffer and not yet trained (in flight or finished) are saved in the
buffer's state as prompts (the ``state_dict`` hook): a resumed run generates them again, so no prompt is lost or
trained twice. Their responses are not kept, nor are partial responses already in the buffer: their weight
versions belong to the interrupted run.

Aborted groups (an engine died, ``--partial-rollout``) go back to the buffer as the default rollout does. Eval
(``evaluation=True``) is the default rollout's eval, run beside the worker. Not with ``--colocate``: the engines
would sleep under running requests (refused at parse time).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from vime.rollout.filter_hub.base_types import DynamicFilterOutput
from vime.rollout.vllm_rollout import (
    MAX_OVERSAMPLING_FACTOR,
    RolloutError,
    finish_train_rollout,
    generate_group,
    load_dynamic_filter,
    reset_to_prompt,
    sampling_params_from_args,
)
from vime.rollout.vllm_rollout import generate_rollout as default_generate_rollout
from vime.utils.async_utils import run
from vime.utils.run_context import RunContext, plugin_args
from vime.utils.types import RolloutFnEvalOutput, RolloutFnTrainOutput, Sample, Status

logger = logging.getLogger(__name__)

DEFAULT_MAX_STALENESS = 2
GenerateGroup = Callable[..., Awaitable[list[Sample]]]


@dataclass
class _Group:
    """A group on its way: as drawn from the data buffer (to draw again, or to checkpoint), the engines' weight
    version when it started, and once finished, as generated."""

    drawn: list[Sample]
    version: int
    samples: list[Sample] | None = None


@dataclass
class _Call:
    """The rollout being collected."""

    rollout_id: int
    train_version: int
    groups: list[list[Sample]] = field(default_factory=list)
    lags: list[int] = field(default_factory=list)


def max_staleness(args) -> int:
    """``--max-staleness``, or its default."""
    return DEFAULT_MAX_STALENESS if args.max_staleness is None else args.max_staleness


def sample_lags(train_version: int, group: _Group) -> list[int]:
    """Each sample's weight-version lag when trained at ``train_version``: against the oldest version that
    generated it (the group's start version for a sample that records none, e.g. a custom generate function's)."""
    return [
        train_version - (min(sample.weight_versions) if sample.weight_versions else group.version)
        for sample in group.samples or []
    ]


class FullyAsyncWorker:
    """Keeps groups generating in the background and hands them out a batch at a time (see the module docstring).
    Every method runs on the rollout's event loop, which also serialises all access to the data buffer."""

    def __init__(self, args, data_source, run_context: RunContext, generate: GenerateGroup | None = None):
        """``generate``: ``async (args, group, sampling_params, rollout_id, *, run_context) -> list[Sample]``
        (default: :func:`vime.rollout.vllm_rollout.generate_group`)."""
        self.args = args
        self.data_source = data_source
        self.run = run_context
        self.generate = generate or generate_group
        self.keep_group = load_dynamic_filter(args)
        self.params = sampling_params_from_args(args)
        self.batch_size = args.rollout_batch_size
        self.per_call = args.over_sampling_batch_size or args.rollout_batch_size
        self.max_staleness = max_staleness(args)
        self.max_in_flight = args.rollout_concurrency * max(1, len(run_context.engine_urls))
        self.in_flight: dict[asyncio.Task, _Group] = {}
        self.ready: deque[_Group] = deque()  # finished, kept by the dynamic filter, in finishing order
        self.call: _Call | None = None
        self.last_call: _Call | None = None
        self.paused = False  # a weight sync is under way
        self.stopped = False
        self.drained = False  # the data source gave no group
        self.error: BaseException | None = None
        self.progress = asyncio.Event()
        # since the last batch
        self.counts: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.filtered_out: list[list[Sample]] = []

    # -- the rollout function's side ------------------------------------------------------------------------------

    async def next_batch(self, rollout_id: int, train_version: int) -> RolloutFnTrainOutput:
        """The next ``--rollout-batch-size`` finished groups that ``train_version`` may train on."""
        started = time.monotonic()
        version = self.run.weight_version
        if train_version - version > self.max_staleness:
            raise RolloutError(
                f"rollout {rollout_id} trains on weight version {train_version} but the engines serve {version}: "
                f"--max-staleness {self.max_staleness} cannot be met (train_async.py pushes weights between "
                "generating a rollout and training on it, so it needs --max-staleness >= 1)"
            )
        self.call = call = _Call(rollout_id, train_version)
        try:
            self._hand_off()
            self._top_up()
            while len(call.groups) < self.batch_size:
                if self.error is not None:
                    raise RolloutError(f"fully-async rollout failed: {self.error!r}") from self.error
                if self.stopped:
                    raise RolloutError(
                        f"the fully-async rollout was stopped while rollout {rollout_id} waited"
                    )
                if sum(self.dropped.values()) >= MAX_OVERSAMPLING_FACTOR * self.per_call:
                    raise RolloutError(
                        f"the dynamic filter dropped {dict(self.dropped)} groups while rollout {rollout_id} collected "
                        f"{len(call.groups)} of {self.batch_size}. Check --dynamic-sampling-filter-path or the task"
                    )
                if self.drained and not self.in_flight and not self.ready and not self.paused:
                    raise RolloutError(
                        f"the data source gave no more groups; rollout {rollout_id} has {len(call.groups)} of "
                        f"{self.batch_size}"
                    )
                self.progress.clear()
                await self.progress.wait()
        finally:
            self.call, self.last_call = None, call
        self._top_up()  # start the groups of the next rollouts while this one trains
        return self._output(call, started)

    def _output(self, call: _Call, started: float) -> RolloutFnTrainOutput:
        kept = sorted(call.groups, key=lambda group: group[0].index or 0)
        counts = {
            "submitted_groups": self.counts["submitted"],
            **{f"dropped_groups/{reason}": count for reason, count in self.dropped.items()},
        }
        output = finish_train_rollout(
            self.args, self.data_source, kept, self.filtered_out, started, counts, run_context=self.run
        )
        lags = call.lags
        output.metrics = {
            **(output.metrics or {}),
            "fully_async/staleness_max": float(max(lags, default=0)),
            "fully_async/staleness_mean": sum(lags) / max(len(lags), 1),
            **{
                f"fully_async/staleness_samples/{lag}": float(lags.count(lag))
                for lag in range(self.max_staleness + 1)
            },
            "fully_async/regenerated_groups": float(self.counts["regenerated"]),
            "fully_async/aborted_groups": float(self.counts["aborted"]),
            "fully_async/ready_groups": float(len(self.ready)),
            "fully_async/in_flight_groups": float(len(self.in_flight)),
            "fully_async/train_weight_version": float(call.train_version),
        }
        self.counts.clear()
        self.dropped.clear()
        self.filtered_out = []
        return output

    # -- the manager's side ---------------------------------------------------------------------------------------

    async def pause(self) -> None:
        """A weight sync starts: start no request until :meth:`resume`."""
        self.paused = True

    async def resume(self) -> None:
        """The sync is done and the run context's ``weight_version`` is the new version: go on."""
        self.paused = False
        self._top_up()
        self._notify()

    async def state_dict(self) -> dict[str, Any]:
        """The data buffer's state with every group it gave out and that is not trained yet back in its buffer, and
        every buffered group reset to its prompt, in drawing order (see the module docstring)."""
        state = self.data_source.state_dict()
        if not isinstance(state.get("buffer"), list):
            raise TypeError(
                f"{type(self.data_source).__name__}.state_dict() has no 'buffer' list: the fully-async rollout puts "
                "the groups it holds there to checkpoint them (as vime's RolloutDataSource does)"
            )
        held = [group.drawn for group in (*self.in_flight.values(), *self.ready)]
        groups = [[Sample.from_dict(sample) for sample in group] for group in state["buffer"]]
        groups += [copy.deepcopy(group) for group in held]
        groups.sort(key=lambda group: group[0].group_index or 0)
        state["buffer"] = [[reset_to_prompt(sample).to_dict() for sample in group] for group in groups]
        return state

    async def stop(self) -> None:
        """Cancel every request in flight (vLLM drops a request whose client went away) and start no more."""
        self.stopped = True
        tasks = list(self.in_flight)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._notify()

    # -- inside ---------------------------------------------------------------------------------------------------

    def _room(self) -> bool:
        """Whether one more group may start: the rollout being collected still needs it, or it would be trained
        within the bound by a later one (groups are handed out in finishing order, a batch per rollout, and each
        rollout trains on at most one weight version more than the previous)."""
        if len(self.in_flight) >= self.max_in_flight:
            return False
        waiting = len(self.ready) + len(self.in_flight)
        if self.call is not None:
            need = self.per_call - len(self.call.groups)
            if waiting < need:
                return True
            base, waiting = self.call.train_version, waiting - need
        elif self.last_call is not None:
            base = self.last_call.train_version
        else:
            return False
        rollouts_later = waiting // self.batch_size + 1
        return base + rollouts_later - self.run.weight_version <= self.max_staleness

    def _top_up(self) -> None:
        while not (self.paused or self.stopped or self.error) and self._room():
            groups = self.data_source.get_samples(1)
            self.drained = not groups  # a custom data source may run dry (vime's cycles through epochs)
            if self.drained:
                return
            self._start(groups[0])

    def _start(self, group: list[Sample]) -> None:
        task = asyncio.ensure_future(
            self.generate(self.args, group, dict(self.params), self._expected_rollout(), run_context=self.run)
        )
        self.in_flight[task] = _Group(copy.deepcopy(group), self.run.weight_version)
        self.counts["submitted"] += 1
        task.add_done_callback(self._finished)

    def _expected_rollout(self) -> int | None:
        """The rollout a group started now should land in (``rollout_id`` for ``--rollout-sample-hook-path``)."""
        if self.call is not None:
            return self.call.rollout_id
        return None if self.last_call is None else self.last_call.rollout_id + 1

    def _finished(self, task: asyncio.Task) -> None:
        group = self.in_flight.pop(task)
        if task.cancelled() or self.stopped:
            return
        try:
            group.samples = task.result()
            if any(sample.status == Status.ABORTED for sample in group.samples):
                back = (
                    group.samples if self.args.partial_rollout else [reset_to_prompt(s) for s in group.drawn]
                )
                self.data_source.add_samples([back])
                self.counts["aborted"] += 1
            else:
                keep = (
                    self.keep_group(plugin_args(self.args, self.run), group.samples)
                    if self.keep_group
                    else DynamicFilterOutput(True)
                )
                if keep.keep:
                    self.ready.append(group)
                else:
                    self.dropped[keep.reason or "unspecified"] += 1
                    self.filtered_out.append(group.samples)
            self._hand_off()
            self._top_up()
        except BaseException as exc:  # noqa: BLE001 - a callback's exception would vanish: the next call raises it
            self.error = self.error or exc
        self._notify()

    def _hand_off(self) -> None:
        """Move finished groups to the rollout being collected; a group too stale for it is drawn again."""
        call = self.call
        while call is not None and self.ready and len(call.groups) < self.batch_size:
            group = self.ready.popleft()
            lags = sample_lags(call.train_version, group)
            if any(lag < 0 or lag > self.max_staleness for lag in lags):
                self.data_source.add_samples([[reset_to_prompt(sample) for sample in group.drawn]])
                self.counts["regenerated"] += 1
                continue
            call.groups.append(group.samples)
            call.lags.extend(lags)

    def _notify(self) -> None:
        self.progress.set()


class FullyAsyncRollout:
    """``--rollout-function-path``: a rollout function with state (:mod:`vime.rollout.lifecycle`); the manager makes
    one per data buffer. The first training call starts the worker; the lifecycle hooks pause it during a weight
    sync, checkpoint the groups it holds, and stop it."""

    def __init__(self, args, data_source):
        self.args = args
        self.data_source = data_source
        self.worker: FullyAsyncWorker | None = None

    def __call__(
        self, args, rollout_id: int, data_source, evaluation: bool = False, *, run_context: RunContext
    ) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
        """The next training batch from the worker; eval as the default rollout."""
        if evaluation:
            return default_generate_rollout(
                args, rollout_id, data_source, evaluation=True, run_context=run_context
            )
        if self.worker is None:
            self.worker = FullyAsyncWorker(self.args, self.data_source, run_context)
            logger.info("fully-async rollout: worker started (--max-staleness %d)", self.worker.max_staleness)
        return run(self.worker.next_batch(rollout_id, run_context.train_weight_version))

    def before_weight_update(self) -> None:
        """The worker starts no request until :meth:`after_weight_update`."""
        if self.worker is not None:
            run(self.worker.pause())

    def after_weight_update(self, version: int) -> None:
        """The engines serve ``version`` (the run context's ``weight_version``, which the worker stamps): the worker
        goes on."""
        if self.worker is not None:
            run(self.worker.resume())

    def state_dict(self) -> dict[str, Any]:
        """The data buffer's state with the groups the worker holds back in its buffer (nothing without a worker)."""
        return {} if self.worker is None else {"data_source": run(self.worker.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the data buffer as :meth:`state_dict` saved it (over the state the manager restored)."""
        if self.worker is not None:
            raise RuntimeError(
                "load the data buffer before the first rollout: a fully-async worker draws from it"
            )
        self.data_source.load_state_dict(state["data_source"])

    def stop(self) -> None:
        """Cancel the worker's requests (at shutdown)."""
        if self.worker is not None:
            run(self.worker.stop())


generate_rollout = generate_rollout_fully_async = FullyAsyncRollout  # vime's and slime's paths
