"""What every training backend does the same way around its own forward/backward (DESIGN.md §6).

:class:`PolicyTrainingMixin` turns one rank's rollout partition into the per-sample tensors the policy loss needs
(old, reference and rollout log-probs, advantages with the on-policy-distillation term and normalisation), and
runs ``--num-steps-per-rollout`` optimizer steps over consecutive chunks. A backend provides ``args``,
``advantage_fn``, ``ref_model``, ``teacher_model`` and the four hooks below; the FSDP2 and Megatron trainers both
mix it in.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vime.utils.ppo_utils import apply_opd_kl
from vime.utils.train_data import compute_advantages_and_returns, normalize_advantages
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


class PolicyTrainingMixin:
    """Backend-neutral policy-side training; see the module docstring."""

    def compute_log_probs(self, samples: list[Sample], model: str = "actor") -> PerSample:
        raise NotImplementedError

    def _reduce_sum(self, values: list[float]) -> list[float]:
        """Sum over the data-parallel ranks (each holds different samples)."""
        raise NotImplementedError

    def _train_step(self, samples: list[Sample], masks: PerSample, data: dict[str, PerSample | None]) -> dict:
        """One optimizer step over ``samples``; metrics are global values."""
        raise NotImplementedError

    def _before_train_step(self, rollout_id: int, step: int) -> None:
        """Called before each optimizer step (the Megatron backend runs a user hook here)."""

    def _data_parallel_group(self) -> dist.ProcessGroup | None:
        """The ranks holding different samples (None: all ranks)."""
        return None

    def _advantages_and_returns(
        self,
        samples: list[Sample],
        rewards: list[float],
        masks: PerSample,
        log_probs: PerSample | None,
        ref_log_probs: PerSample | None,
        values: PerSample | None,
    ) -> tuple[PerSample, PerSample]:
        """``--custom-advantage-function-path`` or the estimator of ``--advantage-estimator``; returns are
        ``advantages + values`` for a custom function (what the critic regresses to)."""
        log_probs, ref_log_probs, values = (
            [t.cpu() for t in ts] if ts is not None else None for ts in (log_probs, ref_log_probs, values)
        )
        if self.advantage_fn is None:
            return compute_advantages_and_returns(self.args, rewards, masks, log_probs, ref_log_probs, values)
        advantages = self.advantage_fn(self.args, samples, rewards, log_probs, ref_log_probs, values)
        returns = (
            [a + v for a, v in zip(advantages, values, strict=True)] if values is not None else advantages
        )
        return advantages, returns

    def _policy_data(
        self,
        samples: list[Sample],
        rewards: list[float],
        masks: PerSample,
        values: PerSample | None,
        log_probs: PerSample | None,
        ref_log_probs: PerSample | None,
    ) -> tuple[dict[str, PerSample | None], dict[str, float]]:
        """The policy loss's per-sample inputs, and the train-vs-rollout log-prob difference as a metric."""
        args = self.args
        rollout_log_probs = rollout_log_probs_of(samples)
        if log_probs is None and args.use_rollout_logprobs:
            if rollout_log_probs is None:
                raise ValueError("--use-rollout-logprobs but some samples carry no rollout_log_probs")
            log_probs = rollout_log_probs
        if log_probs is None:
            log_probs = self.compute_log_probs(samples)
        if ref_log_probs is None and self.ref_model is not None:
            ref_log_probs = self.compute_log_probs(samples, "ref")
        advantages, _ = self._advantages_and_returns(
            samples, rewards, masks, log_probs, ref_log_probs, values
        )
        if self.teacher_model is not None:
            teacher = self.compute_log_probs(samples, "teacher")
            advantages = [
                apply_opd_kl(a, lp.to(a.device), t.to(a.device), args.opd_kl_coef)
                for a, lp, t in zip(advantages, log_probs, teacher, strict=True)
            ]
        if args.normalize_advantages:
            advantages = normalize_advantages(
                [a.cpu() for a in advantages], masks, self._data_parallel_group()
            )
        data = {
            "advantages": advantages,
            "old_log_probs": log_probs,
            "ref_log_probs": ref_log_probs,
            "rollout_log_probs": rollout_log_probs,
        }
        metrics = {}
        if rollout_log_probs is not None:
            metrics["train_rollout_logprob_abs_diff"] = self._masked_abs_diff(
                log_probs, rollout_log_probs, masks
            )
        return data, metrics

    def _masked_abs_diff(self, a: PerSample, b: PerSample, masks: PerSample) -> float:
        """Mean of ``|a − b|`` over the loss-masked tokens of all ranks (tool-output tokens have no rollout
        log-prob)."""
        total, count = self._reduce_sum(
            [
                sum(
                    float(((x.cpu() - y.cpu()).abs() * m).sum()) for x, y, m in zip(a, b, masks, strict=True)
                ),
                float(sum(m.sum() for m in masks)),
            ]
        )
        return total / max(count, 1.0)

    def _optimize(
        self, rollout_id: int, samples: list[Sample], masks: PerSample, data: dict[str, PerSample | None]
    ) -> dict[str, float]:
        """``--num-steps-per-rollout`` optimizer steps over consecutive equal chunks; metrics averaged."""
        steps = self.args.num_steps_per_rollout
        if len(samples) % steps:
            raise ValueError(
                f"{len(samples)} samples on this rank do not split into --num-steps-per-rollout {steps} steps"
            )
        size = len(samples) // steps
        per_step = []
        for step in range(steps):
            chunk = slice(step * size, (step + 1) * size)
            self._before_train_step(rollout_id, step)
            step_data = {k: v[chunk] if v is not None else None for k, v in data.items()}
            per_step.append(self._train_step(samples[chunk], masks[chunk], step_data))
        return {k: sum(m[k] for m in per_step) / steps for k in per_step[0]}
