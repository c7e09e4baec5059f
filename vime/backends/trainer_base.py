"""What every training backend does the same way around its own forward/backward (DESIGN.md §6).

:class:`TrainerBase` implements ``train``: it turns one rank's rollout partition into the per-sample tensors the
policy (or value) loss needs
(old, reference and rollout log-probs, advantages with the on-policy-distillation term and normalisation), and
runs ``--num-steps-per-rollout`` optimizer steps over consecutive chunks. A backend sets ``args``, calls
:meth:`TrainerBase._init_policy_models_and_hooks` and implements ``compute_log_probs``, ``_reduce_sum``
and ``_train_step``; the FSDP2 and Megatron trainers both mix it in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vime.backends.routing_plan import RoutingPlan, make_routing_plan, routing_pass
from vime.utils.loss import make_reducer, policy_loss, sft_loss
from vime.utils.memory_plan import (
    GIB,
    MemoryPlan,
    MemoryProbe,
    plan_memory,
    planned_micro_batch_tokens,
    unallocated_optimizer_state_bytes,
)
from vime.utils.misc import load_function
from vime.utils.mismatch import STAT_KEYS, mismatch_metrics, mismatch_statistics
from vime.utils.offload import GPUOffloader, torch_optimizers
from vime.utils.ppo_utils import apply_opd_kl
from vime.utils.routing_replay import ReplayMode, RoutingReplay
from vime.utils.train_data import (
    PackedBatch,
    compute_advantages_and_returns,
    dynamic_micro_batches,
    fixed_micro_batches,
    is_trainable,
    loss_mask_of,
    min_micro_batches,
    normalize_advantages,
    pack_samples,
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


def _synthetic_samples(total_tokens: int, sample_tokens: int) -> list[Sample]:
    """Samples of ``sample_tokens`` tokens (the last one shorter) totalling ``total_tokens``, each a one-token
    prompt and a response (every position goes through the LM head, the worst case for memory)."""
    generator = torch.Generator().manual_seed(0)
    samples = []
    while total_tokens >= 2:
        length = min(sample_tokens, total_tokens)
        tokens = torch.randint(0, 32, (length,), generator=generator).tolist()  # in any vocabulary
        samples.append(Sample(index=len(samples), tokens=tokens, response_length=length - 1))
        total_tokens -= length
    return samples


class TrainerBase:
    """Backend-neutral training; see the module docstring. ``role`` is ``"actor"`` or ``"critic"``."""

    role = "actor"
    routing: RoutingPlan | None = None  # routing replay of the actor's MoE routers (_init_routing_replay)

    def train(
        self,
        rollout_id: int,
        samples: list[Sample],
        rewards: list[float],
        *,
        values: PerSample | None = None,
        log_probs: PerSample | None = None,
        ref_log_probs: PerSample | None = None,
    ) -> dict[str, float]:
        """Train on this rank's data-parallel partition of rollout ``rollout_id`` (``rewards`` shaped by
        ``shape_rewards``): ``--num-steps-per-rollout`` optimizer steps over consecutive equal chunks. ``values``
        (the critic's, for ppo), ``log_probs`` (old policy) and ``ref_log_probs`` are computed here when None and
        needed; the critic needs the actor's log-probs passed in for ``--kl-coef``. Returns metrics averaged over
        steps (each a global value over all ranks)."""
        if len(rewards) != len(samples):
            raise ValueError(f"{len(samples)} samples but {len(rewards)} rewards")
        masks = [loss_mask_of(s) for s in samples]
        extra: dict[str, float] = {}
        try:
            if self.role == "critic":
                values = values if values is not None else self.compute_values(samples)
                _, returns = self._advantages_and_returns(
                    samples, rewards, masks, log_probs, ref_log_probs, values
                )
                data = {"old_values": values, "returns": returns}
            else:
                data, extra = self._policy_data(samples, rewards, masks, values, log_probs, ref_log_probs)
            metrics = self._optimize(rollout_id, samples, masks, data)
        finally:
            if self.routing is not None:  # the recorded routing belongs to this step only
                self.routing.clear()
        metrics.update(extra)
        interval = getattr(self.args, "ref_update_interval", None)
        if (
            self.role == "actor"
            and self.ref_model is not None
            and interval
            and (rollout_id + 1) % interval == 0
        ):
            self._update_ref_model()
        return metrics

    def _trained_module(self) -> torch.nn.Module:
        """The policy's module whose parameter names match the reference model's."""
        raise NotImplementedError

    @torch.no_grad()
    def _update_ref_model(self) -> None:
        """``--ref-update-interval`` (slime): the reference model takes the policy's current weights."""
        policy = dict(self._trained_module().named_parameters())
        for name, param in self.ref_model.named_parameters():
            source = policy[name]
            if isinstance(param, DTensor):  # both sharded alike (FSDP2): copy this rank's shard
                param.to_local().copy_(source.to_local())
            else:
                param.copy_(source.full_tensor() if isinstance(source, DTensor) else source)

    def _init_policy_models_and_hooks(
        self, build_frozen: Callable[[str, int | None], Any], is_actor: bool = True
    ) -> None:
        """Set ``ref_model`` (``--use-kl-loss`` or ``--kl-coef``), ``teacher_model`` (``--opd-type trainer``) via
        ``build_frozen(path, step)`` (``--ref-ckpt-step`` / ``--opd-teacher-ckpt-step``: a checkpoint iteration, else the
        latest), and ``loss_fn`` / ``advantage_fn`` from ``--custom-loss-function-path`` /
        ``--custom-advantage-function-path``."""
        args = self.args
        wants_ref = is_actor and (args.use_kl_loss or args.kl_coef != 0)
        ref_step = getattr(args, "ref_ckpt_step", None) if args.ref_load else None
        self.ref_model = build_frozen(args.ref_load or args.hf_checkpoint, ref_step) if wants_ref else None
        self.teacher_model = None
        if is_actor and args.use_opd and args.opd_type == "trainer":
            self.teacher_model = build_frozen(
                args.opd_teacher_load, getattr(args, "opd_teacher_ckpt_step", None)
            )
        self.loss_fn: Callable = sft_loss if args.loss_type == "sft_loss" else policy_loss
        if args.custom_loss_function_path:
            self.loss_fn = load_function(args.custom_loss_function_path, "--custom-loss-function-path")
        self.advantage_fn: Callable | None = None
        if args.custom_advantage_function_path:
            self.advantage_fn = load_function(
                args.custom_advantage_function_path, "--custom-advantage-function-path"
            )

    def _init_routing_replay(
        self, num_layers: int, topk: int, num_experts: int | None, attach: Callable[[Any, RoutingReplay], Any]
    ) -> None:
        """``--use-routing-replay`` / ``--use-rollout-routing-replay``: ``self.routing`` (see :func:`make_routing_plan`)."""
        models = (self._trained_module(), self.ref_model)
        self.routing = make_routing_plan(self.args, self.role, models, num_layers, topk, num_experts, attach)

    def _pass_routing(self, model: str, samples: list[Sample]) -> tuple[ReplayMode, list | None]:
        """Routing-replay mode and per-sample routes of a forward-only pass of ``model`` over ``samples``."""
        return self.routing.for_pass(model, samples) if self.routing else (ReplayMode.OFF, None)

    def _routing_pass(self, mode: ReplayMode):
        """Context: the routers record or replay in ``mode`` (see :func:`routing_pass`)."""
        return routing_pass(self.routing, mode)

    def _entropy_needs_grad(self) -> bool:
        """Whether the loss differentiates the entropy: ``--entropy-coef``, or a custom loss (it may)."""
        return bool(self.args.entropy_coef) or self.loss_fn not in (policy_loss, sft_loss)

    def _reset_optimizer_steps(self) -> None:
        """``--reset-optimizer-states`` (slime): after a load, Adam starts counting steps again (its bias
        correction restarts); the moments are kept."""
        for inner in torch_optimizers(self.optimizer):
            for group in inner.param_groups:
                if "step" in group:
                    group["step"] = 0
            for state in inner.state.values():
                step = state.get("step")
                if isinstance(step, torch.Tensor):
                    step.zero_()
                elif step is not None:
                    state["step"] = 0

    def check_memory_plan(self) -> MemoryPlan | None:
        """Before the first step (CUDA only): predict the peak memory of the largest micro-batch the plan allows
        from two smaller synthetic forward/backward passes (:mod:`vime.utils.memory_plan`) and fail now, on every
        rank, with the numbers and the flags to change when it cannot fit. Collective."""
        tokens = planned_micro_batch_tokens(self.args, self._micro_batch_token_budget())
        if not torch.cuda.is_available() or tokens is None or tokens < 64:
            return None
        resident = torch.cuda.memory_allocated()
        free, _ = torch.cuda.mem_get_info()
        available = free + torch.cuda.memory_reserved()
        probes = []
        for size in (
            min(tokens // 4, 2048),
            min(tokens // 2, 4096),
        ):  # small: a probe must not run out itself
            torch.cuda.reset_peak_memory_stats()
            try:
                self._memory_probe(_synthetic_samples(size, self._longest_sample(size)))
            except torch.OutOfMemoryError as e:
                raise MemoryError(
                    f"the {self.role}'s memory check ran out of GPU memory on a micro-batch of only {size} tokens "
                    f"({available / GIB:.1f} GiB usable): the model does not fit this GPU as configured; "
                    "spread it over more GPUs (tensor, pipeline or expert parallelism)"
                ) from e
            probes.append(MemoryProbe(size, torch.cuda.max_memory_allocated()))
        torch.cuda.empty_cache()
        missing = unallocated_optimizer_state_bytes(torch_optimizers(self.optimizer))
        plan = plan_memory(*probes, tokens, resident, missing, available)
        any_over = self._world_max([0 if plan.fits else 1])[0]
        if plan.fits and not any_over:
            tight = "warning: tight, " if plan.predicted_peak_bytes > 0.9 * available else ""
            print(f"[vime] {self.role} memory plan: {tight}{plan.summary()}", flush=True)
            return plan
        if plan.fits:
            raise MemoryError("another training rank's micro-batch plan does not fit in its GPU memory")
        args = self.args
        fix = "--gradient-checkpointing" if args.train_backend == "fsdp" else "--recompute-granularity full"
        if args.use_dynamic_batch_size:  # the budget may be --max-tokens-per-gpu x CP
            lower = f"--max-tokens-per-gpu {plan.max_fitting_tokens * args.max_tokens_per_gpu // tokens}"
        else:
            lower = f"--micro-batch-size {plan.max_fitting_tokens * args.micro_batch_size // tokens}"
        raise MemoryError(
            f"the {self.role}'s {plan.summary()}. Set {lower} or lower, turn on {fix}, or spread the model "
            f"over more GPUs (this process can use {available / GIB:.1f} GiB of this GPU)"
        )

    def _longest_sample(self, tokens: int) -> int:
        """Length of the synthetic samples a memory probe packs: the longest sample the run can produce."""
        args = self.args
        longest = (
            args.rollout_max_context_len or (args.rollout_max_prompt_len or 0) + args.rollout_max_response_len
        )
        return max(min(longest, tokens), 2)

    def _world_max(self, values: list[int]) -> list[int]:
        """Element-wise maximum over every rank of this trainer."""
        tensor = torch.tensor(values, dtype=torch.int64, device="cuda")
        if dist.is_initialized():
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def _memory_probe(self, samples: list[Sample]) -> None:
        """One forward/backward of ``samples`` packed into one micro-batch, gradients then cleared (no step)."""
        raise NotImplementedError

    def offload(self) -> dict[str, float]:
        """``--offload-train``: free the GPU memory of the weights (policy, reference, teacher), gradients and
        optimizer state while the engines generate; :meth:`onload` brings them back. Returns the GiB freed and the
        time taken."""
        if not hasattr(self, "_offloader"):
            self._offloader = GPUOffloader()
        return self._offloader.offload(*self._gpu_state())

    def onload(self) -> dict[str, float]:
        """Bring back what :meth:`offload` freed (a no-op when nothing is offloaded)."""
        if not getattr(self, "_offloader", None) or not self._offloader.offloaded:
            return {}
        return self._offloader.onload()

    def _gpu_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(tensors to keep, tensors whose contents can be dropped) that make up the training state on the GPU."""
        raise NotImplementedError

    def compute_log_probs(self, samples: list[Sample], model: str = "actor") -> PerSample:
        raise NotImplementedError

    def compute_values(self, samples: list[Sample]) -> PerSample:
        raise NotImplementedError

    def _reduce_sum(self, values: list[float]) -> list[float]:
        """Sum over the data-parallel ranks (each holds different samples)."""
        raise NotImplementedError

    def _train_step(self, samples: list[Sample], masks: PerSample, data: dict[str, PerSample | None]) -> dict:
        """One optimizer step over ``samples``; metrics are global values."""
        raise NotImplementedError

    def _reduce_max(self, values: list[int]) -> list[int]:
        """Element-wise maximum over the data-parallel ranks."""
        raise NotImplementedError

    def _reduce_float_max(self, values: list[float]) -> list[float]:
        """Element-wise maximum of floats over the data-parallel ranks."""
        raise NotImplementedError

    def _micro_batch_token_budget(self) -> int | None:
        """Tokens a packed micro-batch may hold (``--max-tokens-per-gpu``: one GPU holds the whole row)."""
        return self.args.max_tokens_per_gpu

    def _micro_batches(self, samples: list[Sample]) -> list[list[int]]:
        """Sample indices of each micro-batch (``--micro-batch-size``, or packed up to ``--max-tokens-per-gpu``
        with ``--use-dynamic-batch-size``). Every data-parallel rank gets the same number of micro-batches
        (collectives run per forward/backward), so ranks must hold equally many samples."""
        args = self.args
        lengths = [len(s.tokens) for s in samples]
        budget = self._micro_batch_token_budget()
        needed = min_micro_batches(lengths, budget) if args.use_dynamic_batch_size else 0
        most, minus_fewest, num_micro_batches = self._reduce_max([len(samples), -len(samples), needed])
        if most != -minus_fewest:
            raise ValueError(
                f"data-parallel ranks hold between {-minus_fewest} and {most} samples; split rollouts with "
                "vime.utils.train_data.split_rollout so every rank gets the same number"
            )
        if args.use_dynamic_batch_size:
            return dynamic_micro_batches(lengths, budget, num_micro_batches)
        return fixed_micro_batches(len(samples), args.micro_batch_size)

    def _micro_batch_inputs(
        self, samples: list[Sample], masks: PerSample, data: dict[str, PerSample | None], device: torch.device
    ) -> tuple[list[tuple[list[int], PackedBatch, dict[str, Any]]], float]:
        """For one optimizer step: each micro-batch's sample indices, packed tokens (with the experts to replay, under
        routing replay) and loss inputs (``batch`` of :func:`~vime.utils.loss.policy_loss`, with a ``reduce``
        normalised by the global sample and token counts), and the step's total token count over all data-parallel
        ranks."""
        args = self.args
        num_samples, num_tokens, total_tokens = self._reduce_sum(
            [len(samples), float(sum(m.sum() for m in masks)), sum(len(s.tokens) for s in samples)]
        )
        routes = self.routing.for_training(samples) if self.routing is not None else None
        inputs = []
        for mb in self._micro_batches(samples):
            packed = pack_samples([samples[i] for i in mb], [routes[i] for i in mb] if routes else None)
            mask = torch.cat([masks[i] for i in mb]).to(device)
            batch: dict[str, Any] = {
                "response_lengths": packed.response_lengths,
                "total_lengths": packed.total_lengths,
                "loss_mask": mask,
                "reduce": make_reducer(
                    mask,
                    packed.response_lengths,
                    args.calculate_per_token_loss,
                    int(num_samples),
                    int(num_tokens),
                ),
            }
            for key, per_sample in data.items():
                batch[key] = (
                    torch.cat([per_sample[i] for i in mb]).to(device) if per_sample is not None else None
                )
            inputs.append((mb, packed, batch))
        return inputs, total_tokens

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
        if (
            self.loss_fn is sft_loss
        ):  # the negative log-likelihood needs no old policy, reference or advantages
            return dict.fromkeys(["advantages", "old_log_probs", "ref_log_probs", "rollout_log_probs"]), {}
        rollout_log_probs = rollout_log_probs_of(samples)
        if log_probs is None and args.use_rollout_logprobs:
            if rollout_log_probs is None:
                raise ValueError("--use-rollout-logprobs but some samples carry no rollout_log_probs")
            log_probs = rollout_log_probs
        if log_probs is None:
            log_probs = self.compute_log_probs(samples)
        if ref_log_probs is None and self.ref_model is not None:
            ref_log_probs = self.compute_log_probs(samples, "ref")
        if args.compute_advantages_and_returns:
            advantages, _ = self._advantages_and_returns(
                samples, rewards, masks, log_probs, ref_log_probs, values
            )
        else:  # --disable-compute-advantages-and-returns: for losses that do not use them
            advantages = [torch.zeros_like(m) for m in masks]
        metrics = {}
        if args.use_opd:
            teacher = (
                self.compute_log_probs(samples, "teacher")
                if self.teacher_model is not None
                else teacher_log_probs_of(samples, log_probs)
            )
            advantages = [
                apply_opd_kl(a, lp.to(a.device), t.to(a.device), args.opd_kl_coef)
                for a, lp, t in zip(advantages, log_probs, teacher, strict=True)
            ]
            metrics["opd_reverse_kl"] = self._masked_mean(
                [lp.cpu() - t.cpu() for lp, t in zip(log_probs, teacher, strict=True)], masks
            )
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
        if rollout_log_probs is not None:
            metrics["train_rollout_logprob_abs_diff"] = self._masked_mean(
                [(x.cpu() - y.cpu()).abs() for x, y in zip(log_probs, rollout_log_probs, strict=True)], masks
            )
        if args.get_mismatch_metrics:
            if rollout_log_probs is None:
                raise ValueError("--get-mismatch-metrics needs the engine's log-probs (rollout_log_probs)")
            trainer_log_probs = self.compute_log_probs(samples) if args.use_rollout_logprobs else log_probs
            metrics |= self._mismatch_metrics(trainer_log_probs, rollout_log_probs, masks)
        return data, metrics

    def _mismatch_metrics(self, train: PerSample, rollout: PerSample, masks: PerSample) -> dict[str, float]:
        """``--get-mismatch-metrics``: :func:`~vime.utils.mismatch.mismatch_metrics` over all ranks' tokens."""
        band = (self.args.tis_clip_low, self.args.tis_clip)
        sums, maxima = mismatch_statistics([t.cpu() for t in train], [t.cpu() for t in rollout], masks, band)
        totals = dict(zip(STAT_KEYS, self._reduce_sum([sums[k] for k in STAT_KEYS]), strict=True))
        names = sorted(maxima)
        extremes = dict(zip(names, self._reduce_float_max([maxima[k] for k in names]), strict=True))
        return mismatch_metrics(totals, extremes)

    def _masked_mean(self, values: PerSample, masks: PerSample) -> float:
        """Mean of ``values`` over the loss-masked tokens of all ranks (tool-output tokens have no rollout
        log-prob)."""
        total, count = self._reduce_sum(
            [
                sum(float((v * m).sum()) for v, m in zip(values, masks, strict=True)),
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
