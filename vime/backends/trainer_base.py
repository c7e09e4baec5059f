"""What every training backend does the same way around its own forward/backward (DESIGN.md §6).

:class:`TrainerBase` is the trainer's interface and owns what the backends share: ``train`` (one rank's rollout
partition turned into the loss's per-sample inputs, :mod:`vime.backends.policy_inputs`, then
``--num-steps-per-rollout`` optimizer steps over consecutive chunks), ``load`` and ``save``, the log-prob and value
passes, micro-batching, offloading, the reference / teacher / old-actor models and slime's per-step hooks. Every
reduction over the data-parallel ranks goes through ``self.dp`` (:class:`~vime.utils.distributed.DataParallel`).

A backend's ``__init__`` sets ``args``, ``role``, ``dp``, ``device``, ``model`` (what its passes run), ``module`` (the
trained module, named as the reference model), ``optimizer``, ``scheduler`` and ``step`` (and ``cp_size`` with
context parallelism), calling :meth:`_start_memory_recording` first and :meth:`_init_policy_models_and_hooks` once
the model exists; then it implements the primitives of :data:`PRIMITIVES` and overrides nothing else
(``tests/unit/test_trainer_interface.py``). The FSDP2 and Megatron trainers are the two backends.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from vime.backends.memory_check import check_memory_plan
from vime.backends.micro_batches import loss_inputs, plan, token_budget
from vime.backends.policy_inputs import PerSample, advantages_and_returns, policy_inputs
from vime.backends.routing_plan import RoutingPlan, make_routing_plan, routing_pass
from vime.utils.checkpoint_layout import iteration_dir, latest_iteration, mark_latest
from vime.utils.distributed import DataParallel
from vime.utils.loss import policy_loss, sft_loss, takes_logits
from vime.utils.memory_plan import MemoryPlan
from vime.utils.misc import load_function
from vime.utils.offload import GPUOffloader, copy_weights, local_shard, torch_optimizers
from vime.utils.routing_replay import ReplayMode, RoutingReplay
from vime.utils.train_data import PackedBatch, loss_mask_of, postprocess_rollout_data
from vime.utils.train_debug import MemoryRecorder, ci_check_rollout, ci_check_step, save_train_data
from vime.utils.types import Sample

__all__ = ["PRIMITIVES", "PerSample", "TrainerBase"]

# What a backend implements (the base raises NotImplementedError, except the defaults noted there); a backend
# overrides nothing else.
PRIMITIVES = frozenset(
    {
        "_forward",
        "_train_step",
        "_memory_probe",
        "_probe_gradient_bytes",
        "_gpu_state",
        "_load_checkpoint",
        "_load_weights",
        "_save_checkpoint",
        "export_hf",
        "iter_weight_buckets",
    }
)


class TrainerBase:
    """Backend-neutral training; see the module docstring. ``role`` is ``"actor"`` or ``"critic"``."""

    role = "actor"
    cp_size = 1  # context-parallel ranks sharing each micro-batch's row (Megatron's --context-parallel-size)
    routing: RoutingPlan | None = None  # routing replay of the actor's MoE routers (_init_routing_replay)
    dp: DataParallel

    @property
    def dp_rank(self) -> int:
        return self.dp.rank

    @property
    def dp_size(self) -> int:
        return self.dp.size

    @property
    def learning_rate(self) -> float:
        """``--lr``, or ``--critic-lr`` for the critic when set."""
        critic_lr = self.args.critic_lr if self.role == "critic" else None
        return self.args.lr if critic_lr is None else critic_lr

    def _seed(self) -> None:
        """``--seed`` for torch, ``random`` and numpy, the same on every rank (a critic's new value head must start
        identical everywhere)."""
        torch.manual_seed(self.args.seed)
        random.seed(self.args.seed)
        np.random.seed(self.args.seed)

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
                _, returns = advantages_and_returns(
                    self, samples, rewards, masks, log_probs, ref_log_probs, values
                )
                data = {"old_values": values, "returns": returns}
            else:
                data, extra = policy_inputs(self, samples, rewards, masks, values, log_probs, ref_log_probs)
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
        if self.role == "actor" and self.args.save_debug_train_data and self.dp.is_leader:
            entropy = data.pop("rollout_entropy", None)
            save_train_data(self.args.save_debug_train_data, rollout_id, self.dp_rank, {
                "sample_indices": [s.index for s in samples], "tokens": [torch.tensor(s.tokens) for s in samples],
                "response_lengths": [s.response_length for s in samples], "rewards": rewards, "loss_masks": masks,
                "values": values, "entropy": entropy, **data,
            })  # fmt: skip
        if self.memory_recorder is not None:
            self.memory_recorder.after_rollout(rollout_id)
        interval = self.args.ref_update_interval
        if (
            self.role == "actor"
            and self.ref_model is not None
            and interval
            and (rollout_id + 1) % interval == 0
        ):
            self._update_ref_model()
        return metrics

    def _update_ref_model(self) -> None:
        """``--ref-update-interval`` (slime): the reference model takes the policy's current weights."""
        copy_weights(self.ref_model, self.module.named_parameters())

    def after_weight_sync(self) -> None:
        """``--keep-old-actor`` (slime): the old actor takes the weights the engines generated the coming rollout
        with. With ``--update-weights-interval 1`` (``train_async.py`` trains on a rollout made before the last
        sync) those are the previous sync's: kept on the host from one sync to the next; otherwise the current."""
        if self.old_actor_model is None:
            return
        current = self.module.named_parameters()
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
        module = self.module
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
        ``--custom-advantage-function-path``, and the hooks of ``--custom-megatron-before-log-prob-hook-path`` /
        ``--custom-megatron-before-train-step-hook-path``."""
        args = self.args
        wants_ref = is_actor and (args.use_kl_loss or args.kl_coef != 0)
        ref_step = args.ref_ckpt_step if args.ref_load else None
        self.ref_model = build_frozen(args.ref_load or args.hf_checkpoint, ref_step) if wants_ref else None
        self.teacher_model = None
        if is_actor and args.use_opd and args.opd_type == "trainer":
            self.teacher_model = build_frozen(args.opd_teacher_load, args.opd_teacher_ckpt_step)
        self.old_actor_model = (
            build_frozen(args.hf_checkpoint, None) if is_actor and args.keep_old_actor else None
        )
        self._rollout_weights: dict[str, torch.Tensor] | None = None
        self.postprocess_fn = (
            load_function(args.rollout_data_postprocess_path, "--rollout-data-postprocess-path")
            if args.rollout_data_postprocess_path
            else None
        )
        if args.save_debug_train_data and "{rank}" not in args.save_debug_train_data and self.dp.size > 1:
            raise ValueError(
                f"--save-debug-train-data {args.save_debug_train_data}: {self.dp.size} data-parallel ranks each write "
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
        # slime's per-pass and per-step hooks (Megatron flags: refused with the fsdp backend at parse time)
        self.before_log_prob_hook = self.before_train_step_hook = None
        if args.custom_megatron_before_log_prob_hook_path:
            self.before_log_prob_hook = load_function(
                args.custom_megatron_before_log_prob_hook_path, "--custom-megatron-before-log-prob-hook-path"
            )
        if args.custom_megatron_before_train_step_hook_path:
            self.before_train_step_hook = load_function(
                args.custom_megatron_before_train_step_hook_path,
                "--custom-megatron-before-train-step-hook-path",
            )

    def _init_routing_replay(
        self, num_layers: int, topk: int, num_experts: int | None, attach: Callable[[Any, RoutingReplay], Any]
    ) -> None:
        """``--use-routing-replay`` / ``--use-rollout-routing-replay``: ``self.routing`` (see :func:`make_routing_plan`)."""
        models = (self.module, self.ref_model)
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
        if self.before_log_prob_hook is not None:
            self.before_log_prob_hook(self.args, nets[model], samples, model)
        return self._forward(nets[model], samples, model, with_entropy)

    def compute_values(self, samples: list[Sample]) -> PerSample:
        """The critic's values at the response tokens of this rank's samples, as CPU fp32 tensors; no grad."""
        if self.role != "critic":
            raise ValueError("compute_values needs the critic trainer (role='critic')")
        return self._forward(self.model, samples, "critic")[0]

    # ------------------------------------------------------------------------------------------ checkpoints
    def load(self) -> int | None:
        """Resume from ``--load`` (``--critic-load`` for the critic) at ``--ckpt-step``, else the iteration in
        ``latest_checkpointed_iteration.txt``: weights, optimizer (unless ``--no-load-optim``), LR scheduler, RNG
        (unless ``--no-load-rng``) and step. Returns the saved rollout id. ``--finetune`` loads the weights only and
        returns None; so does a fresh start, where the actor takes ``--ref-load``'s weights when they are not
        ``--hf-checkpoint``'s."""
        args = self.args
        flag, load_dir = (
            ("--critic-load", args.critic_load) if self.role == "critic" else ("--load", args.load)
        )
        step = args.ckpt_step if args.ckpt_step is not None else latest_iteration(load_dir)
        if load_dir and step is not None:
            if not (iter_dir := iteration_dir(load_dir, step)).is_dir():
                raise FileNotFoundError(
                    f"no checkpoint {iter_dir} ({flag} {load_dir}, --ckpt-step {args.ckpt_step})"
                )
            if args.finetune:
                self._load_weights(load_dir, step)
                return None
            optimizer = None if args.no_load_optim else self.optimizer
            state = self._load_checkpoint(load_dir, step, optimizer, not args.no_load_rng)
            self.step = state["step"]
            if args.reset_optimizer_states:
                self._reset_optimizer_steps()
            return state["rollout_id"]
        if (
            self.role == "actor"
            and args.ref_load
            and Path(args.ref_load).resolve() != Path(args.hf_checkpoint).resolve()
        ):
            self._load_weights(args.ref_load, None)
        return None

    def save(self, rollout_id: int, save_dir: str, mark: bool = True) -> None:
        """Write ``save_dir/iter_{rollout_id:07d}`` (optimizer state unless ``--no-save-optim``) and, with ``mark``,
        point ``latest_checkpointed_iteration.txt`` at it (without: :meth:`mark_saved` later, once what else
        belongs to the checkpoint is written). Collective."""
        self._save_checkpoint(save_dir, rollout_id, None if self.args.no_save_optim else self.optimizer)
        if mark:
            self.mark_saved(rollout_id, save_dir)

    def mark_saved(self, rollout_id: int, save_dir: str) -> None:
        """Declare ``save_dir``'s iteration ``rollout_id`` complete: what a resume's ``--load`` finds. Collective."""
        if dist.get_rank() == 0:
            mark_latest(save_dir, rollout_id)
        dist.barrier()

    # ------------------------------------------------------------------------------------- the primitives
    def _load_checkpoint(self, load_dir: str, step: int, optimizer: Any | None, load_rng: bool) -> dict:
        """Restore the weights, ``optimizer`` when given, the LR scheduler and (``load_rng``) this rank's RNG from
        ``load_dir``'s iteration ``step``; its saved state (``rollout_id``, ``step``). Collective."""
        raise NotImplementedError

    def _load_weights(self, path: str, step: int | None) -> None:
        """The trained module's weights only (and nothing of the optimizer's but its copy of them), from a vime
        checkpoint directory (its iteration ``step``, default the latest) or a Hugging Face directory. Collective."""
        raise NotImplementedError

    def _save_checkpoint(self, save_dir: str, rollout_id: int, optimizer: Any | None) -> None:
        """Write iteration ``rollout_id`` (weights, ``optimizer`` when given, scheduler, RNG, step), every rank's
        files written when it returns. Collective."""
        raise NotImplementedError

    def export_hf(self, out_dir: str) -> None:
        """Save a Hugging Face directory: the weights in the training dtype, and ``--hf-checkpoint``'s config and
        tokenizer. Collective."""
        raise NotImplementedError

    def iter_weight_buckets(self, buffer_bytes: int, stack_experts: bool = False) -> Iterator[Any]:
        """HF-named full weights in buckets of at most ``buffer_bytes`` (``vime.utils.weight_buckets``); with
        ``stack_experts`` routed experts stay stacked per layer (``vime.utils.stacked_experts``). Collective."""
        raise NotImplementedError

    def _forward(
        self, net: Any, samples: list[Sample], model: str, with_entropy: bool = False
    ) -> tuple[PerSample, PerSample | None]:
        """Per-sample CPU fp32 outputs of ``net`` (``model``: "actor", "ref", "teacher", "old_actor" or "critic"):
        log-probs (values for the critic) and, with ``with_entropy``, entropies; no grad; MoE routers replay or
        record as the routing plan says."""
        raise NotImplementedError

    def _train_step(self, samples: list[Sample], masks: PerSample, data: dict[str, PerSample | None]) -> dict:
        """One optimizer step over ``samples`` (micro-batches from :meth:`_micro_batch_inputs`); metrics are global
        values (summed over ``self.dp``), with ``grad_norm``, ``lr``, ``step_time_s`` and ``tokens_per_s``."""
        raise NotImplementedError

    def _memory_probe(self, samples: list[Sample]) -> None:
        """One forward/backward of ``samples`` packed into one micro-batch, with every gradient resident as in a
        step's later micro-batches; gradients then cleared (no step)."""
        raise NotImplementedError

    def _probe_gradient_bytes(self) -> int:
        """Bytes of gradients :meth:`_memory_probe` allocates that a step keeps resident (none where a gradient
        buffer exists from the start, as Megatron's)."""
        return 0

    def _gpu_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(tensors to keep, tensors whose contents can be dropped) that make up the training state on the GPU."""
        raise NotImplementedError

    # ---------------------------------------------------------------------------------------------- training
    def _micro_batch_token_budget(self, forward_only: bool = False) -> int | None:
        """See :func:`~vime.backends.micro_batches.token_budget`."""
        return token_budget(self.args, self.cp_size, forward_only)

    def _micro_batches(self, samples: list[Sample], forward_only: bool = False) -> list[list[int]]:
        """Sample indices of each micro-batch of this rank's ``samples`` (:func:`~vime.backends.micro_batches.plan`)."""
        return plan(self.args, samples, self._micro_batch_token_budget(forward_only), self.dp)

    def _micro_batch_inputs(
        self, samples: list[Sample], masks: PerSample, data: dict[str, PerSample | None], device: torch.device
    ) -> tuple[list[tuple[list[int], PackedBatch, dict[str, Any]]], float]:
        """One optimizer step's micro-batches and loss inputs on ``device``
        (:func:`~vime.backends.micro_batches.loss_inputs`)."""
        routes = self.routing.for_training(samples) if self.routing is not None else None
        return loss_inputs(
            self.args, samples, masks, data, self._micro_batches(samples), routes, self.dp, device,
            with_tokens=self.loss_takes_logits,
        )  # fmt: skip

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
            if self.before_train_step_hook is not None:
                self.before_train_step_hook(
                    self.args, rollout_id, step, self.model, self.optimizer, self.scheduler
                )
            step_data = {k: v[chunk] if v is not None else None for k, v in data.items()}
            per_step.append(self._train_step(samples[chunk], masks[chunk], step_data))
            if self.args.use_stateless_adam:  # slime: Adam's moments start at zero again every step
                for inner in torch_optimizers(self.optimizer):
                    inner.state.clear()
            same_policy = self.old_actor_model is None and not self.args.use_rollout_logprobs
            ci_check_step(self.args, self.role, rollout_id, step, per_step[-1], same_policy)
        return {k: sum(m[k] for m in per_step) / steps for k in per_step[0]}
