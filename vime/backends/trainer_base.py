"""What every training backend does the same way around its own forward/backward (DESIGN.md §6).

:class:`TrainerBase` implements ``train``: it turns one rank's rollout partition into the per-sample tensors the
policy (or value) loss needs
(old, reference and rollout log-probs, advantages with the on-policy-distillation term and normalisation), and
runs ``--num-steps-per-rollout`` optimizer steps over consecutive chunks. A backend sets ``args``, calls
:meth:`TrainerBase._init_policy_models_and_hooks` and implements ``compute_log_probs``, ``_reduce_sum``
and ``_train_step``; the FSDP2 and Megatron trainers both mix it in.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from vime.backends.memory_check import check_memory_plan
from vime.backends.routing_plan import RoutingPlan, make_routing_plan, routing_pass
from vime.utils.flops import sequence_flops
from vime.utils.loss import make_reducer, policy_loss, sft_loss, takes_logits
from vime.utils.memory_plan import MemoryPlan
from vime.utils.misc import load_function
from vime.utils.mismatch import STAT_KEYS, mismatch_metrics, mismatch_statistics
from vime.utils.offload import GPUOffloader, copy_weights, local_shard, torch_optimizers
from vime.utils.ppo_utils import apply_opd_kl
from vime.utils.routing_replay import ReplayMode, RoutingReplay
from vime.utils.train_data import (
    PackedBatch,
    balanced_partitions,
    compute_advantages_and_returns,
    dynamic_micro_batches,
    fixed_micro_batches,
    is_trainable,
    loss_mask_of,
    min_micro_batches,
    normalize_advantages,
    pack_samples,
    postprocess_rollout_data,
    slime_custom_advantages,
)
from vime.utils.train_debug import MemoryRecorder, ci_check_rollout, ci_check_step, save_train_data
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


def trajectory_key(sample: Sample) -> tuple[str, int | None]:
    """The trajectory a sample belongs to: its ``rollout_id`` when a plug-in set one (slime's meaning), else itself."""
    return ("trajectory", sample.rollout_id) if sample.rollout_id is not None else ("sample", sample.index)


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
                if self.postprocess_fn is not None:
                    masks = postprocess_rollout_data(
                        self.postprocess_fn, self.args, rollout_id, samples, rewards, masks, data, values
                    )
                ci_check_rollout(self.args, extra)
            metrics = self._optimize(rollout_id, samples, masks, data)
        finally:
            if self.routing is not None:  # the recorded routing belongs to this step only
                self.routing.clear()
        metrics.update(extra)
        if self.role == "actor" and self.args.save_debug_train_data and self._is_data_parallel_leader():
            entropy = data.pop("rollout_entropy", None)
            save_train_data(self.args.save_debug_train_data, rollout_id, self.dp_rank, {
                "sample_indices": [s.index for s in samples], "tokens": [torch.tensor(s.tokens) for s in samples],
                "response_lengths": [s.response_length for s in samples], "rewards": rewards, "loss_masks": masks,
                "values": values, "entropy": entropy, **data,
            })  # fmt: skip
        if self.memory_recorder is not None:
            self.memory_recorder.after_rollout(rollout_id)
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

    def _update_ref_model(self) -> None:
        """``--ref-update-interval`` (slime): the reference model takes the policy's current weights."""
        copy_weights(self.ref_model, self._trained_module().named_parameters())

    def after_weight_sync(self) -> None:
        """``--keep-old-actor`` (slime): the old actor takes the weights the engines generated the coming rollout
        with. With ``--update-weights-interval 1`` (``train_async.py`` trains on a rollout made before the last
        sync) those are the previous sync's: kept on the host from one sync to the next; otherwise the current."""
        if self.old_actor_model is None:
            return
        current = self._trained_module().named_parameters()
        if self.args.update_weights_interval != 1:
            copy_weights(self.old_actor_model, current)
            return
        snapshot = {name: local_shard(param).detach().to("cpu", copy=True) for name, param in current}
        copy_weights(self.old_actor_model, (self._rollout_weights or snapshot).items())
        self._rollout_weights = snapshot

    @contextmanager
    def rollout_weights_loaded(self) -> Iterator[None]:
        """Within: the policy holds the weights the engines generate the current rollout with, so engines that lost
        them can be given that version again (replacements while the actor is a step ahead: ``train_async.py``).
        ``--keep-old-actor`` has them: kept on the host from the last sync (``--update-weights-interval 1``), else
        the old actor's (taken at the last sync). The trained weights come back after."""
        if self.old_actor_model is None or (
            self.args.update_weights_interval == 1 and self._rollout_weights is None
        ):
            raise RuntimeError("no weights kept from the last sync: that needs --keep-old-actor and a sync")
        engines = (
            self._rollout_weights.items()
            if self.args.update_weights_interval == 1
            else self.old_actor_model.named_parameters()
        )
        module = self._trained_module()
        trained = {
            name: local_shard(param).detach().to("cpu", copy=True)
            for name, param in module.named_parameters()
        }
        copy_weights(module, engines)
        try:
            yield
        finally:
            copy_weights(module, trained.items())

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
        self.old_actor_model = (
            build_frozen(args.hf_checkpoint, None) if is_actor and args.keep_old_actor else None
        )
        self._rollout_weights: dict[str, torch.Tensor] | None = None
        self.postprocess_fn = (
            load_function(args.rollout_data_postprocess_path, "--rollout-data-postprocess-path")
            if args.rollout_data_postprocess_path
            else None
        )
        if args.save_debug_train_data and "{rank}" not in args.save_debug_train_data and self.dp_size > 1:
            raise ValueError(
                f"--save-debug-train-data {args.save_debug_train_data}: {self.dp_size} data-parallel ranks each write "
                "their own file; put {rank} in the path"
            )
        self.loss_fn: Callable = sft_loss if args.loss_type == "sft_loss" else policy_loss
        if args.custom_loss_function_path:
            self.loss_fn = load_function(args.custom_loss_function_path, "--custom-loss-function-path")
        # a custom loss written for slime: fn(args, batch, logits, sum_of_sample_mean)
        self.loss_takes_logits = takes_logits(self.loss_fn)
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

    @property
    def old_policy(self) -> str:
        """The model whose log-probs are the old policy's: ``old_actor`` with ``--keep-old-actor``, else ``actor``."""
        return "old_actor" if self.old_actor_model is not None else "actor"

    def _start_memory_recording(self) -> None:
        """``--record-memory-history``, from before the model is built (a backend calls this first)."""
        self.memory_recorder = None
        if self.args.record_memory_history:
            rank = dist.get_rank() if dist.is_initialized() else 0
            self.memory_recorder = MemoryRecorder(self.args, self.role, rank)
            self.memory_recorder.start()

    def _is_data_parallel_leader(self) -> bool:
        """Whether this rank speaks for its data-parallel rank (its model-parallel peers hold the same data)."""
        return True

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
        """Before the first step (CUDA only): fail now, with the numbers and the flags to change, when the largest
        planned micro-batch cannot fit (:func:`vime.backends.memory_check.check_memory_plan`). Collective."""
        return check_memory_plan(self)

    def _memory_probe(self, samples: list[Sample]) -> None:
        """One forward/backward of ``samples`` packed into one micro-batch, with every gradient resident as in a
        step's later micro-batches; gradients then cleared (no step)."""
        raise NotImplementedError

    def _probe_gradient_bytes(self) -> int:
        """Bytes of gradients :meth:`_memory_probe` allocates that a step keeps resident (none where a gradient
        buffer exists from the start, as Megatron's)."""
        return 0

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
        """Response-token log-probs of this rank's samples under the policy (or ``"ref"`` / ``"teacher"`` /
        ``"old_actor"``), at ``--rollout-temperature``, as CPU fp32 tensors; no grad."""
        return self.compute_log_probs_and_entropy(samples, model, with_entropy=False)[0]

    def compute_log_probs_and_entropy(
        self, samples: list[Sample], model: str = "actor", with_entropy: bool = True
    ) -> tuple[PerSample, PerSample | None]:
        """:meth:`compute_log_probs` and the entropy of each predicting distribution (``--use-rollout-entropy``)."""
        nets = {
            "actor": self.model,
            "ref": self.ref_model,
            "teacher": self.teacher_model,
            "old_actor": self.old_actor_model,
        }
        if self.role != "actor" or nets.get(model) is None:
            raise ValueError(f"the {self.role} trainer has no {model!r} model")
        self._before_log_probs(nets[model], samples, model)
        return self._forward(nets[model], samples, model, with_entropy)

    def compute_values(self, samples: list[Sample]) -> PerSample:
        """The critic's values at the response tokens of this rank's samples, as CPU fp32 tensors; no grad."""
        if self.role != "critic":
            raise ValueError("compute_values needs the critic trainer (role='critic')")
        return self._forward(self.model, samples, "critic")[0]

    def _forward(
        self, net: Any, samples: list[Sample], model: str, with_entropy: bool = False
    ) -> tuple[PerSample, PerSample | None]:
        """Per-sample CPU fp32 outputs of ``net`` (``model``: "actor", "ref", "teacher", "old_actor" or "critic"):
        log-probs (values for the critic) and, with ``with_entropy``, entropies; no grad; MoE routers replay or
        record as the routing plan says."""
        raise NotImplementedError

    def _before_log_probs(self, net: Any, samples: list[Sample], model: str) -> None:
        """Called before a log-prob pass (the Megatron backend runs slime's before-log-prob hook here)."""

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

    def _micro_batch_token_budget(self, forward_only: bool = False) -> int | None:
        """Tokens a packed micro-batch may hold (``--max-tokens-per-gpu``, ``--log-probs-max-tokens-per-gpu`` for
        forward-only passes: one GPU holds the whole row)."""
        args = self.args
        return (
            (args.log_probs_max_tokens_per_gpu or args.max_tokens_per_gpu)
            if forward_only
            else args.max_tokens_per_gpu
        )

    def _micro_batches(self, samples: list[Sample], forward_only: bool = False) -> list[list[int]]:
        """Sample indices of each micro-batch (``--micro-batch-size``, or packed up to ``--max-tokens-per-gpu``
        with ``--use-dynamic-batch-size``; by estimated FLOPs with ``--balance-by-flops``). Every data-parallel
        rank gets the same number of micro-batches (collectives run per forward/backward), so ranks must hold
        equally many samples."""
        args = self.args
        lengths = [len(s.tokens) for s in samples]
        budget = self._micro_batch_token_budget(forward_only)
        needed = 0
        if args.use_dynamic_batch_size:
            needed = (
                min(len(samples), -(-sum(lengths) // budget))  # slime: the tokens' share of the budget
                if args.balance_by_flops
                else min_micro_batches(lengths, budget)
            )
        most, minus_fewest, num_micro_batches = self._reduce_max([len(samples), -len(samples), needed])
        if most != -minus_fewest:
            raise ValueError(
                f"data-parallel ranks hold between {-minus_fewest} and {most} samples; split rollouts with "
                "vime.utils.train_data.split_rollout so every rank gets the same number"
            )
        if args.use_dynamic_batch_size and args.balance_by_flops:  # may exceed the token budget (slime)
            flops = sequence_flops(lengths, args.hf_checkpoint)
            return sorted(balanced_partitions(flops, max(num_micro_batches, 1), equal_size=False))
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
        num_samples, num_tokens, total_tokens, in_trajectories = self._reduce_sum(
            [
                len(samples),
                float(sum(m.sum() for m in masks)),
                sum(len(s.tokens) for s in samples),
                sum(s.rollout_id is not None for s in samples),
            ]
        )
        denominators = None
        if in_trajectories:
            num_samples, denominators = self._trajectory_denominators(samples, masks)
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
                    None
                    if denominators is None
                    else torch.tensor([denominators[i] for i in mb], device=device),
                ),
            }
            for key, per_sample in data.items():
                batch[key] = (
                    torch.cat([per_sample[i] for i in mb]).to(device) if per_sample is not None else None
                )
            if self.loss_takes_logits:  # slime's custom losses read the samples' tokens
                batch["unconcat_tokens"] = [torch.tensor(samples[i].tokens) for i in mb]
            inputs.append((mb, packed, batch))
        return inputs, total_tokens

    def _trajectory_denominators(self, samples: list[Sample], masks: PerSample) -> tuple[int, list[float]]:
        """slime's loss over trajectories: the samples sharing a ``rollout_id`` (one trajectory split into several
        samples, e.g. the turns or agents of one episode) form one token-weighted mean, and the optimizer step
        averages over trajectories. Returns the number of trajectories in the step over all data-parallel ranks and
        each sample's denominator: its trajectory's loss-masked tokens (a sample without ``rollout_id`` is its own
        trajectory)."""
        local: Counter = Counter()
        for sample, mask in zip(samples, masks, strict=True):
            local[trajectory_key(sample)] += float(mask.sum())
        group = self._data_parallel_group()
        gathered: list[Counter | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        totals: Counter = Counter()
        for part in gathered:
            totals.update(part)
        return len(totals), [totals[trajectory_key(s)] for s in samples]

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
        """``--custom-advantage-function-path`` or the estimator of ``--advantage-estimator``. A custom function
        with slime's contract ``fn(args, rollout_data)`` sets both; with vime's, ``fn(args, samples, rewards,
        log_probs, ref_log_probs, values) -> advantages``, the returns are ``advantages + values`` (what the critic
        regresses to)."""
        log_probs, ref_log_probs, values = (
            [t.cpu() for t in ts] if ts is not None else None for ts in (log_probs, ref_log_probs, values)
        )
        if self.advantage_fn is None:
            return compute_advantages_and_returns(self.args, rewards, masks, log_probs, ref_log_probs, values)
        if len(inspect.signature(self.advantage_fn).parameters) == 2:
            return slime_custom_advantages(
                self.advantage_fn, self.args, samples, rewards, masks, log_probs, ref_log_probs, values
            )
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
        old_policy = self.old_policy
        entropy = None
        if args.use_rollout_entropy:  # slime: the old policy's entropy, for loss-mask post-processing
            computed, entropy = self.compute_log_probs_and_entropy(samples, old_policy)
            log_probs = computed if log_probs is None else log_probs
        if log_probs is None:
            log_probs = self.compute_log_probs(samples, old_policy)
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
        if args.use_score_centering:
            data |= sampler_heads_of(samples, args.score_centering_top_k)
        if entropy is not None:
            data["rollout_entropy"] = entropy
            metrics["rollout_entropy"] = self._masked_mean(entropy, masks)
        if rollout_log_probs is not None:
            metrics["train_rollout_logprob_abs_diff"] = self._masked_mean(
                [(x.cpu() - y.cpu()).abs() for x, y in zip(log_probs, rollout_log_probs, strict=True)], masks
            )
            if args.log_logprob_diff_without_replay and self.routing is not None and self.routing.rollout:
                own = self._log_probs_own_routing(samples, old_policy)
                metrics["train_rollout_logprob_abs_diff_without_replay"] = self._masked_mean(
                    [(x.cpu() - y.cpu()).abs() for x, y in zip(own, rollout_log_probs, strict=True)], masks
                )
        if args.get_mismatch_metrics:
            if rollout_log_probs is None:
                raise ValueError("--get-mismatch-metrics needs the engine's log-probs (rollout_log_probs)")
            trainer_log_probs = self.compute_log_probs(samples) if args.use_rollout_logprobs else log_probs
            metrics |= self._mismatch_metrics(trainer_log_probs, rollout_log_probs, masks)
        return data, metrics

    def _log_probs_own_routing(self, samples: list[Sample], model: str) -> PerSample:
        """:meth:`compute_log_probs` of ``model`` with every MoE router on its own choice, even under R3."""
        plan, self.routing = self.routing, None
        try:
            return self.compute_log_probs(samples, model)
        finally:
            self.routing = plan

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
                sum(float((v.cpu() * m).sum()) for v, m in zip(values, masks, strict=True)),
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
            if self.args.use_stateless_adam:  # slime: Adam's moments start at zero again every step
                for inner in torch_optimizers(self.optimizer):
                    inner.state.clear()
            same_policy = self.old_actor_model is None and not self.args.use_rollout_logprobs
            ci_check_step(self.args, self.role, rollout_id, step, per_step[-1], same_policy)
        return {k: sum(m[k] for m in per_step) / steps for k in per_step[0]}
