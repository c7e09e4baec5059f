"""Reward functions: the built-ins picked by ``--rm-type`` and :func:`reward_samples`, which the rollout calls.

Built-ins (``--rm-type``, slime's names and meanings): ``math``, ``gsm8k``, ``f1``, ``exact``, ``deepscaler``,
``dapo`` (a dict reward: train on ``--reward-key score``), ``gpqa``, ``random``, ``remote_rm``, and ``boxed_<type>``
(score only the last ``\\boxed{...}`` of the response with ``exact``, ``f1``, ``gsm8k`` or ``gpqa``). A sample's ``metadata["rm_type"]``
overrides ``--rm-type`` for that sample (multi-task data). A user reward function given by ``--custom-rm-path``
has the signature ``async rm(args, sample, **kwargs) -> float | dict``, or with ``--group-rm``
``async rm(args, samples) -> list[float | dict]`` (DESIGN.md §3).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

from vime.rollout.rm_hub.dapo import compute_dapo_reward
from vime.rollout.rm_hub.deepscaler import compute_deepscaler_reward
from vime.rollout.rm_hub.exact import compute_exact_reward
from vime.rollout.rm_hub.f1 import compute_f1_reward
from vime.rollout.rm_hub.gpqa import compute_gpqa_reward
from vime.rollout.rm_hub.gsm8k import compute_gsm8k_reward
from vime.rollout.rm_hub.math_utils import compute_math_reward, extract_boxed, grade_answer_verl
from vime.rollout.rm_hub.remote import remote_rm
from vime.utils.misc import load_function
from vime.utils.rm_types import RM_TYPES, check_rm_type
from vime.utils.types import Sample, Status

# grade_answer_verl: slime's plug-ins import it from here (``from slime.rollout.rm_hub import grade_answer_verl``)
__all__ = ["RM_TYPES", "async_rm", "batched_async_rm", "check_rm_type", "grade_answer_verl", "reward_samples"]

logger = logging.getLogger(__name__)

# Rule-based rewards: (response, label, metadata) -> float | dict, cheap enough to run on the event loop.
_RULE_BASED: dict[str, Callable[[str, Any, dict], float | dict]] = {
    "math": lambda response, label, _: compute_math_reward(response, label),
    "gsm8k": lambda response, label, _: compute_gsm8k_reward(response, label),
    "f1": lambda response, label, _: compute_f1_reward(response, label),
    "exact": lambda response, label, _: compute_exact_reward(response, label),
    "deepscaler": lambda response, label, _: compute_deepscaler_reward(response, label),
    "dapo": lambda response, label, _: compute_dapo_reward(response, label),
    "gpqa": compute_gpqa_reward,
    "random": lambda *_: float(random.randint(0, 1)),
}


async def async_rm(args: Any, sample: Sample, **kwargs: Any) -> float | dict[str, Any]:
    """One sample's reward, as slime's: the sample's own ``custom_rm_path`` (slime's per-dataset eval setting), else
    ``--custom-rm-path``, else the built-in named by its ``metadata["rm_type"]`` or ``--rm-type`` (unknown names
    raise ``ValueError``)."""
    custom_path = sample.custom_rm_path or args.custom_rm_path
    if custom_path:
        return await load_function(custom_path, "--custom-rm-path")(args, sample, **kwargs)
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = check_rm_type(metadata.get("rm_type") or getattr(args, "rm_type", None))
    if rm_type == "remote_rm":
        return await remote_rm(args, sample)
    response = sample.response
    if rm_type.startswith("boxed_"):
        response, rm_type = extract_boxed(response) or "", rm_type.removeprefix("boxed_")
    return _RULE_BASED[rm_type](response, sample.label, metadata)


async def batched_async_rm(args: Any, samples: list[Sample], **kwargs: Any) -> list[float | dict[str, Any]]:
    """The rewards of ``samples``, as slime's: ``--custom-rm-path`` called once with the list (a group reward
    function), else :func:`async_rm` for every sample, concurrently; the first exception propagates."""
    if args.custom_rm_path:
        return await load_function(args.custom_rm_path, "--custom-rm-path")(args, samples, **kwargs)
    return list(await asyncio.gather(*(async_rm(args, sample, **kwargs) for sample in samples)))


async def _builtin_group_rm(args: Any, samples: list[Sample]) -> list[float | dict[str, Any]]:
    return list(await asyncio.gather(*(async_rm(args, sample) for sample in samples)))


async def reward_samples(args: Any, samples: list[Sample]) -> int:
    """Set ``sample.reward`` on every sample; return how many samples the reward step marked FAILED.

    Uses ``--custom-rm-path`` if set, else the built-in ``--rm-type``. Each call is bounded by
    ``--rm-timeout`` seconds (``None``: no limit). A call that raises, times out or returns something other
    than a number or dict marks its sample(s) FAILED with the reason and reward 0.0; the others go on.
    With ``--group-rm`` the function is called once with the list and must return one reward per sample
    (a wrong length raises ``ValueError``: that is a bug in the function, not in a sample).

    Samples that are already FAILED (generation failed) are skipped: they get no reward, are not passed
    to the reward function, and are not counted in the return value.
    """
    custom_path = getattr(args, "custom_rm_path", None)
    group_rm = getattr(args, "group_rm", False)
    todo = [sample for sample in samples if sample.status != Status.FAILED]
    if custom_path:
        rm_fn = load_function(custom_path, "--custom-rm-path")
        source = f"--custom-rm-path {custom_path}"
    else:
        rm_fn = _builtin_group_rm if group_rm else async_rm
        source = f"--rm-type {getattr(args, 'rm_type', None)}"
        for sample in todo:  # a wrong name is the run's configuration, not a sample's failure: stop here
            metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
            check_rm_type(metadata.get("rm_type") or getattr(args, "rm_type", None))
    timeout_s = getattr(args, "rm_timeout", None)

    if group_rm:
        if not todo:
            return 0
        rewards, reason = await _call_bounded(rm_fn, args, todo, timeout_s, source)
        if reason is None:
            if not isinstance(rewards, list | tuple) or len(rewards) != len(todo):
                got = (
                    f"{len(rewards)} rewards" if isinstance(rewards, list | tuple) else type(rewards).__name__
                )
                raise ValueError(
                    f"group reward function ({source}) returned {got} for {len(todo)} samples; "
                    "with --group-rm it must return a list with one reward per sample"
                )
            results = [(reward, _check_reward(reward)) for reward in rewards]
        else:
            results = [(None, reason)] * len(todo)
    else:
        results = await asyncio.gather(
            *(_call_bounded(rm_fn, args, sample, timeout_s, source) for sample in todo)
        )
        results = [(reward, reason or _check_reward(reward)) for reward, reason in results]

    failures = 0
    for sample, (reward, reason) in zip(todo, results, strict=True):
        if reason is None:
            sample.reward = reward
        else:
            sample.mark_failed(reason)
            sample.reward = 0.0
            failures += 1
    if failures:
        first = next(reason for _, reason in results if reason is not None)
        logger.warning("reward failed for %d of %d samples; first reason: %s", failures, len(todo), first)
    return failures


async def _call_bounded(
    rm_fn: Callable[..., Awaitable[Any]], args: Any, arg: Any, timeout_s: float | None, source: str
) -> tuple[Any, str | None]:
    """``(reward, None)`` on success, ``(None, reason)`` if the call raised or ran past ``timeout_s``."""
    pending = rm_fn(args, arg)
    if not inspect.isawaitable(pending):
        # A configuration error, not a sample's: let it stop the run.
        raise TypeError(
            f"reward function ({source}) returned {type(pending).__name__}; define it `async def`"
        )
    try:
        # asyncio.timeout (not wait_for) so a TimeoutError raised inside the function is reported as raised.
        async with asyncio.timeout(timeout_s) as deadline:
            return await pending, None
    except Exception as exc:
        if isinstance(exc, TimeoutError) and deadline.expired():
            return None, f"reward timed out after {timeout_s}s"
        return None, f"reward function raised {type(exc).__name__}: {exc}"


def _check_reward(reward: Any) -> str | None:
    if isinstance(reward, int | float | dict):
        return None
    return f"reward function returned {type(reward).__name__}; expected a float or a dict"
