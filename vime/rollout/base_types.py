"""The rollout functions' output types where slime plug-ins import them (``slime.rollout.base_types``), and
:func:`call_rollout_fn`, which calls a rollout or eval function as its signature asks and takes every return shape
slime accepts from one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vime.utils.run_context import RunContext, call_plugin
from vime.utils.types import RolloutFnEvalOutput, RolloutFnTrainOutput, Sample

__all__ = ["RolloutFnEvalOutput", "RolloutFnTrainOutput", "call_rollout_fn"]


def call_rollout_fn(
    fn: Callable[..., Any],
    args: Any,
    rollout_id: int,
    data_source: Any,
    *,
    evaluation: bool,
    run_context: RunContext,
) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """Call a rollout (``evaluation=False``) or eval function, one of vime's with ``run_context=`` and one with slime's
    signature with the plug-in view of ``args`` (:func:`~vime.utils.run_context.call_plugin`), and return its
    output as vime's type, as slime does:
    a bare ``list[list[Sample]]`` becomes ``RolloutFnTrainOutput(samples=...)`` and a bare ``{name: {...}}`` dict
    ``RolloutFnEvalOutput(data=...)``. A group may nest lists of samples (a generate function that returned several
    samples for one, e.g. an agent's turns): they are flattened into the group, in order. Anything else raises
    ``TypeError`` naming the function and what it returned; a sample with slime's multimodal inputs raises
    ``ValueError`` (vime's trainers are text-only)."""
    output = call_plugin(fn, args, rollout_id, data_source, evaluation=evaluation, run_context=run_context)
    # a class's instance (vime.rollout.lifecycle) is named by its class
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    if evaluation:
        if isinstance(output, dict):
            output = RolloutFnEvalOutput(data=output)
        if not isinstance(output, RolloutFnEvalOutput):
            raise TypeError(
                f"eval function {name} returned {type(output).__name__}; expected RolloutFnEvalOutput or a dict "
                "{dataset: {'rewards': [...], 'truncated': [...], 'samples': [...]}}"
            )
        return output
    if isinstance(output, list):
        output = RolloutFnTrainOutput(samples=output)
    if not isinstance(output, RolloutFnTrainOutput):
        raise TypeError(
            f"rollout function {name} returned {type(output).__name__}; expected RolloutFnTrainOutput or a "
            "list[list[Sample]] (one list per prompt group)"
        )
    output.samples = [_flat_group(group, name, i) for i, group in enumerate(output.samples)]
    return output


def _flat_group(group: Any, name: str, position: int) -> list[Sample]:
    if isinstance(group, Sample):
        raise TypeError(
            f"rollout function {name} returned a flat list of samples (item {position} is a Sample); return one "
            "list per prompt group: list[list[Sample]]"
        )
    flat: list[Sample] = []
    pending = [group]
    while pending:
        item = pending.pop()
        if isinstance(item, Sample):
            flat.append(item)
        elif isinstance(item, list | tuple):
            pending.extend(reversed(item))
        else:
            raise TypeError(
                f"rollout function {name}: group {position} holds a {type(item).__name__}; groups hold Samples "
                "(or lists of them)"
            )
    if not flat:
        raise TypeError(f"rollout function {name}: group {position} has no samples")
    for sample in flat:
        images = any(v is not None for v in (sample.multimodal_inputs or {}).values())
        if images or sample.multimodal_train_inputs is not None:
            raise ValueError(
                f"rollout function {name}: sample {sample.index} carries multimodal inputs (slime's "
                "multimodal_inputs / multimodal_train_inputs); vime trains text-only models and would drop them"
            )
    return flat
