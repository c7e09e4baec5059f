"""The per-sample inputs of the policy (and value) loss that a training rank computes before its optimizer steps: old,
reference, rollout and teacher log-probs, advantages and returns (the estimator or a custom function, the OPD term,
normalisation over the data-parallel batch), the sampler's heads, and the metrics that compare trainer and rollout.

The functions take the trainer (:class:`vime.backends.trainer_base.TrainerBase`) for its flags, its models' log-prob
passes and its data-parallel group.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from vime.utils.distributed import DataParallel
from vime.utils.loss import sft_loss
from vime.utils.mismatch import STAT_KEYS, mismatch_metrics, mismatch_statistics
from vime.utils.ppo_utils import apply_opd_kl
from vime.utils.train_data import (
    compute_advantages_and_returns,
    is_trainable,
    normalize_advantages,
    slime_custom_advantages,
)
from vime.utils.types import Sample

PerSample = list[torch.Tensor]


def rollout_log_probs_of(samples: list[Sample]) -> PerSample | None:
    """The engine's log-probs of each sample's response tokens, or None when any sample has none."""
    if any(s.rollout_log_probs is None for s in samples):
        return None
    for s in samples:
        if len(s.rollout_log_probs) != s.response_length:
            raise ValueError(
                f"sample {s.index}: len(rollout_log_probs)={len(s.rollout_log_probs)} != "
                f"response_length={s.response_length}"
            )
    return [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]


def sampler_heads_of(samples: list[Sample], top_k: int) -> dict[str, PerSample]:
    """The sampler's top-k head per response token (``--use-score-centering``): ``rollout_topk_token_ids`` (int64)
    and ``rollout_topk_log_probs`` (fp32), each ``[response_length, top_k]`` per sample (slime's fields)."""
    heads: dict[str, PerSample] = {"rollout_topk_token_ids": [], "rollout_topk_log_probs": []}
    for s in samples:
        for key, dtype in (
            ("rollout_topk_token_ids", torch.int64),
            ("rollout_topk_log_probs", torch.float32),
        ):
            value = getattr(s, key)
            if value is None:
                raise ValueError(
                    f"--use-score-centering: sample {s.index} carries no {key}; the rollout must record the "
                    f"sampler's top-{top_k} tokens and log-probs of every response token"
                )
            head = torch.as_tensor(value, dtype=dtype)
            if head.shape != (s.response_length, top_k):
                raise ValueError(
                    f"--use-score-centering: sample {s.index} has {key} of shape {tuple(head.shape)}, expected "
                    f"({s.response_length}, {top_k}) (response tokens, --score-centering-top-k)"
                )
            heads[key].append(head)
    return heads


def teacher_log_probs_of(samples: list[Sample], log_probs: PerSample) -> PerSample:
    """The teacher's log-probs each sample carries (``--opd-type vllm``: set during the rollout by
    :mod:`vime.rollout.on_policy_distillation`). A sample that does not train (FAILED, e.g. its teacher call failed,
    or ``remove_sample``) may have none: it gets the student's own (a zero OPD term)."""
    teacher = []
    for s, student in zip(samples, log_probs, strict=True):
        if s.teacher_log_probs is None:
            if is_trainable(s):
                raise ValueError(
                    f"sample {s.index} has no teacher_log_probs, which --use-opd --opd-type vllm needs: reward with "
                    "--custom-rm-path vime.rollout.on_policy_distillation.reward_func --rm-url TEACHER_URL (or set "
                    "sample.teacher_log_probs in your own reward or generate function)"
                )
            teacher.append(student.detach().cpu().float())
            continue
        if len(s.teacher_log_probs) != s.response_length:
            raise ValueError(
                f"sample {s.index}: len(teacher_log_probs)={len(s.teacher_log_probs)} != "
                f"response_length={s.response_length}"
            )
        teacher.append(torch.tensor(s.teacher_log_probs, dtype=torch.float32))
    return teacher


def advantages_and_returns(
    trainer: Any,
    samples: list[Sample],
    rewards: list[float],
    masks: PerSample,
    log_probs: PerSample | None,
    ref_log_probs: PerSample | None,
    values: PerSample | None,
) -> tuple[PerSample, PerSample]:
    """``--custom-advantage-function-path`` or the estimator of ``--advantage-estimator``. A custom function
    with slime's contract ``fn(args, rollout_data)`` sets both; with vime's, ``fn(args, samples, rewards,
    log_probs, ref_log_probs, values) -> advantages``, the returns are ``advantages + values`` (what the critic
    regresses to)."""
    log_probs, ref_log_probs, values = (
        [t.cpu() for t in ts] if ts is not None else None for ts in (log_probs, ref_log_probs, values)
    )
    if trainer.advantage_fn is None:
        return compute_advantages_and_returns(trainer.args, rewards, masks, log_probs, ref_log_probs, values)
    if len(inspect.signature(trainer.advantage_fn).parameters) == 2:
        return slime_custom_advantages(
            trainer.advantage_fn, trainer.args, samples, rewards, masks, log_probs, ref_log_probs, values
        )
    advantages = trainer.advantage_fn(trainer.args, samples, rewards, log_probs, ref_log_probs, values)
    returns = [a + v for a, v in zip(advantages, values, strict=True)] if values is not None else advantages
    return advantages, returns


def policy_inputs(
    trainer: Any,
    samples: list[Sample],
    rewards: list[float],
    masks: PerSample,
    values: PerSample | None,
    log_probs: PerSample | None,
    ref_log_probs: PerSample | None,
) -> tuple[dict[str, PerSample | None], dict[str, float]]:
    """The policy loss's per-sample inputs, and the train-vs-rollout log-prob difference as a metric."""
    args = trainer.args
    if (
        trainer.loss_fn is sft_loss
    ):  # the negative log-likelihood needs no old policy, reference or advantages
        return dict.fromkeys(["advantages", "old_log_probs", "ref_log_probs", "rollout_log_probs"]), {}
    rollout_log_probs = rollout_log_probs_of(samples)
    if log_probs is None and args.use_rollout_logprobs:
        if rollout_log_probs is None:
            raise ValueError("--use-rollout-logprobs but some samples carry no rollout_log_probs")
        log_probs = rollout_log_probs
    old_policy = trainer.old_policy
    entropy = None
    if args.use_rollout_entropy:  # slime: the old policy's entropy, for loss-mask post-processing
        computed, entropy = trainer.compute_log_probs_and_entropy(samples, old_policy)
        log_probs = computed if log_probs is None else log_probs
    if log_probs is None:
        log_probs = trainer.compute_log_probs(samples, old_policy)
    if ref_log_probs is None and trainer.ref_model is not None:
        ref_log_probs = trainer.compute_log_probs(samples, "ref")
    if args.compute_advantages_and_returns:
        advantages, _ = advantages_and_returns(
            trainer, samples, rewards, masks, log_probs, ref_log_probs, values
        )
    else:  # --disable-compute-advantages-and-returns: for losses that do not use them
        advantages = [torch.zeros_like(m) for m in masks]
    metrics = {}
    if args.use_opd:
        teacher = (
            trainer.compute_log_probs(samples, "teacher")
            if trainer.teacher_model is not None
            else teacher_log_probs_of(samples, log_probs)
        )
        advantages = [
            apply_opd_kl(a, lp.to(a.device), t.to(a.device), args.opd_kl_coef)
            for a, lp, t in zip(advantages, log_probs, teacher, strict=True)
        ]
        metrics["opd_reverse_kl"] = masked_mean(
            trainer.dp, [lp.cpu() - t.cpu() for lp, t in zip(log_probs, teacher, strict=True)], masks
        )
    if args.normalize_advantages:
        advantages = normalize_advantages([a.cpu() for a in advantages], masks, trainer.dp.group)
    data = {
        "advantages": advantages,
        "old_log_probs": log_probs,
        "ref_log_probs": ref_log_probs,
        "rollout_log_probs": rollout_log_probs,
    }
    if args.use_score_centering:
        data |= sampler_heads_of(samples, args.score_centering_top_k)
    if entropy is not None:
        data["rollout_entropy"] = entropy
        metrics["rollout_entropy"] = masked_mean(trainer.dp, entropy, masks)
    if rollout_log_probs is not None:
        metrics["train_rollout_logprob_abs_diff"] = masked_mean(
            trainer.dp,
            [(x.cpu() - y.cpu()).abs() for x, y in zip(log_probs, rollout_log_probs, strict=True)],
            masks,
        )
        if args.log_logprob_diff_without_replay and trainer.routing is not None and trainer.routing.rollout:
            own = _log_probs_own_routing(trainer, samples, old_policy)
            metrics["train_rollout_logprob_abs_diff_without_replay"] = masked_mean(
                trainer.dp,
                [(x.cpu() - y.cpu()).abs() for x, y in zip(own, rollout_log_probs, strict=True)],
                masks,
            )
    if args.get_mismatch_metrics:
        if rollout_log_probs is None:
            raise ValueError("--get-mismatch-metrics needs the engine's log-probs (rollout_log_probs)")
        trainer_log_probs = trainer.compute_log_probs(samples) if args.use_rollout_logprobs else log_probs
        metrics |= _mismatch_metrics(trainer, trainer_log_probs, rollout_log_probs, masks)
    return data, metrics


def _log_probs_own_routing(trainer: Any, samples: list[Sample], model: str) -> PerSample:
    """``trainer.compute_log_probs`` of ``model`` with every MoE router on its own choice, even under R3."""
    plan, trainer.routing = trainer.routing, None
    try:
        return trainer.compute_log_probs(samples, model)
    finally:
        trainer.routing = plan


def _mismatch_metrics(
    trainer: Any, train: PerSample, rollout: PerSample, masks: PerSample
) -> dict[str, float]:
    """``--get-mismatch-metrics``: :func:`~vime.utils.mismatch.mismatch_metrics` over all ranks' tokens."""
    band = (trainer.args.tis_clip_low, trainer.args.tis_clip)
    sums, maxima = mismatch_statistics([t.cpu() for t in train], [t.cpu() for t in rollout], masks, band)
    totals = dict(zip(STAT_KEYS, trainer.dp.sum([sums[k] for k in STAT_KEYS]), strict=True))
    names = sorted(maxima)
    extremes = dict(zip(names, trainer.dp.max([maxima[k] for k in names]), strict=True))
    return mismatch_metrics(totals, extremes)


def masked_mean(dp: DataParallel, values: PerSample, masks: PerSample) -> float:
    """Mean of ``values`` over the loss-masked tokens of all ranks (tool-output tokens have no rollout
    log-prob)."""
    total, count = dp.sum(
        [
            sum(float((v.cpu() * m).sum()) for v, m in zip(values, masks, strict=True)),
            float(sum(m.sum() for m in masks)),
        ]
    )
    return total / max(count, 1.0)
