"""The default rollout: token-in/token-out generation through vllm-router, rewards, dynamic sampling.

``generate_rollout(args, rollout_id, data_source, evaluation=False, *, run_context)`` is the
``--rollout-function-path`` default (DESIGN.md §3): slime's signature, and the run's
:class:`~vime.utils.run_context.RunContext` (router, engines, weight version) as a keyword-only argument. It keeps ``args.rollout_batch_size`` groups that pass the dynamic filter, submitting
``--over-sampling-batch-size`` prompts at a time, then aborts the surplus in-flight requests on every engine.
Aborted and surplus groups go back to the data buffer: with ``--partial-rollout`` as they are (to resume),
otherwise reset to their prompts, so no prompt is silently skipped.

Per-sample and per-group generation lives in ``vime.rollout.vllm_generate`` (requests in
``vime.rollout.router_client``); their plug-in API (``generate``, ``generate_and_rm``, ``generate_and_rm_group``,
``append_response``, ``get_context``, ...) and :class:`~vime.rollout.generate_state.GenerateState` are re-exported
here, where slime's plug-ins find ``sglang_rollout``'s (``slime.rollout.sglang_rollout`` → ``vime.rollout.vllm_rollout``).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from vime.rollout.eval_metrics import pass_rates
from vime.rollout.eval_rollout import run_eval
from vime.rollout.filter_hub.base_types import DynamicFilterOutput
from vime.rollout.generate_state import GenerateState, abort
from vime.rollout.router_client import (
    RolloutContext,
    RolloutError,
    SampleGenerationError,
    close_contexts,
    get_context,
)
from vime.rollout.vllm_generate import (
    append_response,
    generate,
    generate_and_rm,
    generate_and_rm_group,
    generate_group,
    get_model_url,
    max_new_tokens,
    reset_to_prompt,
    sampling_params_from_args,
)
from vime.utils.async_utils import run
from vime.utils.misc import load_function
from vime.utils.run_context import RunContext, plugin_args, run_context_of
from vime.utils.types import RolloutFnTrainOutput, Sample, Status

__all__ = [  # the generation API plug-ins import from here (defined in vime.rollout.vllm_generate, generate_state)
    "GenerateState",
    "RolloutContext",
    "RolloutError",
    "SampleGenerationError",
    "abort",
    "append_response",
    "close_contexts",
    "generate",
    "generate_and_rm",
    "generate_and_rm_group",
    "generate_group",
    "generate_rollout",
    "get_context",
    "get_model_url",
    "max_new_tokens",
    "sampling_params_from_args",
    "train_rollout",
]

# Give up when the dynamic filter has dropped this many times the batch without filling it.
MAX_OVERSAMPLING_FACTOR = 20
ABORT_RETRY_S = 0.2


async def train_rollout(
    args,
    rollout_id: int,
    data_source,
    sampling_params: dict[str, Any],
    *,
    run_context: RunContext | None = None,
) -> RolloutFnTrainOutput:
    """One training batch with the given vLLM sampling fields (the default rollout passes
    :func:`sampling_params_from_args`; a custom rollout function may add its own, e.g. ``ignore_eos``)."""
    run_context = run_context_of(args, run_context)
    ctx = get_context(args, run_context=run_context)
    started = time.monotonic()
    params = sampling_params
    keep_group = load_dynamic_filter(args)
    target = args.rollout_batch_size
    per_round = args.over_sampling_batch_size or target
    kept: list[list[Sample]] = []
    filtered_out: list[
        list[Sample]
    ] = []  # groups the dynamic filter dropped (for --rollout-all-samples-process-path)
    dropped: Counter[str] = Counter()
    pending: dict[asyncio.Task, list[Sample]] = {}
    submitted = 0
    try:
        while len(kept) < target:
            if len(kept) + len(pending) < target:
                if submitted >= MAX_OVERSAMPLING_FACTOR * target:
                    raise RolloutError(
                        f"the dynamic filter kept {len(kept)} of {submitted} groups (dropped: {dict(dropped)}); "
                        f"it needs {target}. Check --dynamic-sampling-filter-path or the task difficulty"
                    )
                for group in data_source.get_samples(per_round):
                    task = generate_group(args, group, params, rollout_id, run_context=run_context)
                    pending[asyncio.create_task(task)] = group
                    submitted += 1
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                pending.pop(task)
                samples = task.result()
                verdict = (
                    keep_group(plugin_args(args, run_context), samples)
                    if keep_group
                    else DynamicFilterOutput(keep=True)
                )
                if verdict.keep:
                    kept.append(samples)
                else:
                    dropped[verdict.reason or "unspecified"] += 1
                    filtered_out.append(samples)
        returned = await _abort_pending(ctx, pending) + kept[target:]
    except BaseException:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        raise
    if not args.partial_rollout:
        returned = [[reset_to_prompt(s) for s in group] for group in returned]
    output = finish_train_rollout(
        args,
        data_source,
        kept[:target],
        filtered_out,
        started,
        {
            "submitted_groups": submitted,
            "returned_to_buffer_groups": len(returned),
            **{f"dropped_groups/{reason}": count for reason, count in dropped.items()},
        },
        run_context=run_context,
    )
    data_source.add_samples(returned)
    return output


def load_dynamic_filter(args) -> Callable[[Any, list[Sample]], DynamicFilterOutput] | None:
    """The ``--dynamic-sampling-filter-path`` function (None: every group is kept)."""
    path = args.dynamic_sampling_filter_path
    return load_function(path, "--dynamic-sampling-filter-path") if path else None


def finish_train_rollout(
    args,
    data_source,
    kept: list[list[Sample]],
    filtered_out: list[list[Sample]],
    started: float,
    counts: dict[str, float],
    *,
    run_context: RunContext,
) -> RolloutFnTrainOutput:
    """A training batch from the kept groups (shared by the default and the fully-async rollout): slime's
    ``--rollout-sample-filter-path`` and ``--rollout-all-samples-process-path`` hooks (the latter also sees the
    groups the dynamic filter dropped), then the batch metrics, ``counts`` among them as ``rollout/<key>``.
    Must run on the rollout's event loop."""
    view = plugin_args(args, run_context)  # what slime's hooks get as args
    if args.rollout_sample_filter_path:  # slime's hook: set remove_sample on samples that should not train
        load_function(args.rollout_sample_filter_path, "--rollout-sample-filter-path")(view, kept)
    if args.rollout_all_samples_process_path:  # slime's hook: every finished group, the filtered ones too
        process = load_function(args.rollout_all_samples_process_path, "--rollout-all-samples-process-path")
        process(view, sorted(kept + filtered_out, key=lambda group: group[0].index or 0), data_source)
    metrics = rollout_metrics(kept, args.reward_key)
    if getattr(args, "log_passrate", False):  # slime's --log-passrate: pass@k of the kept groups
        metrics |= {f"rollout/{key}": value for key, value in pass_rates(kept, args.reward_key).items()}
    metrics |= {f"rollout/{key}": value for key, value in counts.items()}
    metrics["rollout/time_s"] = time.monotonic() - started
    if getattr(args, "use_fault_tolerance", False):
        ctx = get_context(args, run_context=run_context)
        metrics["fault/requeued_samples"], ctx.requeued_samples = float(ctx.requeued_samples), 0
    metrics["rollout/tokens_per_s"] = metrics["rollout/response_tokens"] / max(
        metrics["rollout/time_s"], 1e-9
    )
    return RolloutFnTrainOutput(samples=kept, metrics=metrics)


async def _abort_pending(
    ctx: RolloutContext, pending: dict[asyncio.Task, list[Sample]]
) -> list[list[Sample]]:
    """Abort in-flight requests until every pending group has returned; give back those groups.

    Engines must be resumed right after the abort (a request reaching a paused engine waits for resume), so
    requests still in transit (client pool, router queue) start after it: abort again every
    ``ABORT_RETRY_S`` until every group is back.
    """
    groups = []
    ctx.aborting = True
    try:
        while pending:
            await ctx.abort_all()
            done, _ = await asyncio.wait(pending, timeout=ABORT_RETRY_S)
            for task in done:
                pending.pop(task)
                groups.append(task.result())
    finally:
        ctx.aborting = False
    return groups


def rollout_metrics(groups: list[list[Sample]], reward_key: str | None) -> dict[str, float]:
    """Reward, length and status statistics of the kept groups."""
    samples = [s for group in groups for s in group]
    rewarded = [
        s.reward_value(reward_key) for s in samples if s.status != Status.FAILED and s.reward is not None
    ]
    statuses = Counter(s.status for s in samples)
    lengths = [s.response_length for s in samples]
    n = max(len(samples), 1)
    return {
        "rollout/reward_mean": sum(rewarded) / max(len(rewarded), 1),
        "rollout/response_length_mean": sum(lengths) / n,
        "rollout/response_tokens": sum(lengths),
        "rollout/truncated_ratio": statuses[Status.TRUNCATED] / n,
        "rollout/failed_samples": statuses[Status.FAILED],
        "rollout/reward_failures": sum(1 for s in samples if (s.failure_reason or "").startswith("reward")),
    }


def generate_rollout(
    args, rollout_id: int, data_source, evaluation: bool = False, *, run_context: RunContext | None = None
):
    """Default ``--rollout-function-path``: a training batch, or (``evaluation=True``) the eval datasets."""
    run_context = run_context_of(args, run_context)
    if evaluation:
        return run(run_eval(args, rollout_id, run_context=run_context))
    params = sampling_params_from_args(args)
    return run(train_rollout(args, rollout_id, data_source, params, run_context=run_context))
