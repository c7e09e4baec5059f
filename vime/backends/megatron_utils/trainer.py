"""``MegatronTrainer``: the Megatron-Core training backend, one instance per GPU rank (DESIGN.md §1, §7).

Same public interface as ``vime.backends.fsdp_utils.trainer.FSDPTrainer``; every public method is collective.
``samples`` are this rank's *data-parallel* partition: the tensor/pipeline/expert-parallel peers of a rank get
the same samples. Losses are ``vime.utils.loss`` on packed (THD) micro-batches; log-probs are computed
vocab-parallel (``log_probs.py``). The critic (``role="critic"``, for ppo) is the same model with a value head
(``model.add_value_head``) trained with ``vime.utils.loss.value_loss``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from vime.backends.megatron_utils import checkpoint, weights
from vime.backends.megatron_utils.config import (
    compute_dtype,
    ddp_config_kwargs,
    load_hook,
    optimizer_config_kwargs,
    role_args,
)
from vime.backends.megatron_utils.grad_norm import use_foreach_grad_norm
from vime.backends.megatron_utils.grouped_experts import check_expert_patterns
from vime.backends.megatron_utils.hf_config import check_hf_config, load_hf_config
from vime.backends.megatron_utils.log_probs import vocab_parallel_log_probs
from vime.backends.megatron_utils.model import (
    add_value_head,
    build_gpt_model,
    packed_seq_params,
    transformer_config,
)
from vime.backends.megatron_utils.packed_layout import PackedLayout
from vime.backends.megatron_utils.routing_replay import (
    attach_routing_replay,
    full_row_routing,
    local_routing,
)
from vime.backends.micro_batches import add_metrics, metric_sums
from vime.backends.trainer_base import PerSample, TrainerBase
from vime.utils.distributed import DataParallel, init_distributed
from vime.utils.freeze import apply_trainable_patterns
from vime.utils.loss import value_loss
from vime.utils.offload import optimizer_tensors
from vime.utils.routing_replay import ReplayMode
from vime.utils.train_data import PackedBatch, pack_samples, split_routing
from vime.utils.types import Sample
from vime.utils.weight_buckets import Bucket

ROLES = ("actor", "critic")


def init_megatron_parallel(args: argparse.Namespace) -> None:
    """torch.distributed (NCCL) plus Megatron's TP/PP/CP/EP groups; a no-op when already done."""
    init_distributed(args.distributed_timeout_minutes, args.distributed_backend)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)


class MegatronTrainer(TrainerBase):
    """The policy (``role="actor"``) on Megatron-Core, with a frozen reference model when ``--use-kl-loss`` or
    ``--kl-coef`` and a frozen teacher with ``--opd-kl-coef``; or the value model (``role="critic"``, lr
    ``--critic-lr``, checkpoints ``--critic-load``), whose new value head starts from ``--seed``. Hooks: ``--custom-loss-function-path`` and
    ``--custom-advantage-function-path`` as for ``FSDPTrainer``; ``--custom-megatron-init-path``
    ``fn(args)`` after the parallel groups exist; ``--custom-megatron-before-log-prob-hook-path``
    ``fn(args, model, samples, which)``; ``--custom-megatron-before-train-step-hook-path``
    ``fn(args, rollout_id, step_id, model, optimizer, scheduler)``; ``--megatron-config-path`` per-role flags."""

    def __init__(self, args: argparse.Namespace, role: str = "actor"):
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        args = role_args(args, role)
        if args.fp16:
            raise ValueError("--fp16 is not supported by the Megatron backend (no loss scaling); use --bf16")
        init_megatron_parallel(args)
        self.args, self.role = args, role
        # TP/CP/PP peers hold the same samples: every reduction over samples is over the data-parallel group only,
        # and one rank among the peers (TP and CP rank 0, last pipeline stage) speaks for them
        self.dp = DataParallel(
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(),
            parallel_state.get_data_parallel_group(),
            is_leader=parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0
            and parallel_state.is_pipeline_last_stage(),
        )
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._start_memory_recording()
        self._seed()
        if args.custom_megatron_init_path:
            load_hook(args.custom_megatron_init_path, "--custom-megatron-init-path")(args)
        hf_config = load_hf_config(args.hf_checkpoint)
        check_hf_config(args, hf_config, f"{args.hf_checkpoint}/config.json")
        self.hf_vocab_size = hf_config["vocab_size"]
        self.config = transformer_config(args)
        self.dtype = compute_dtype(args)

        module = self._load_module(args.hf_checkpoint)
        freeze, only_train = args.freeze_params_name_list, args.only_train_params_name_list
        check_expert_patterns(
            module, {"--freeze-params-name-list": freeze, "--only-train-params-name-list": only_train}
        )
        apply_trainable_patterns(module, freeze, only_train)
        ddp_config = DistributedDataParallelConfig(**ddp_config_kwargs(args))
        self.model = DistributedDataParallel(self.config, ddp_config, module)
        self.module = module
        optim_config = OptimizerConfig(**optimizer_config_kwargs(args, self.learning_rate))
        use_foreach_grad_norm()
        self.optimizer = get_megatron_optimizer(optim_config, [self.model])
        self.scheduler = self._scheduler(self.learning_rate)
        self.step = 0
        self._init_policy_models_and_hooks(self._frozen, is_actor=role == "actor")
        if self.loss_takes_logits:
            raise ValueError(
                f"--custom-loss-function-path {args.custom_loss_function_path} takes slime's (args, batch, logits, "
                "sum_of_sample_mean): the Megatron backend calls custom losses fn(args, batch, log_probs, entropy) "
                "(its logits are vocabulary- and sequence-parallel shards); use that signature (batch['reduce'] is "
                "sum_of_sample_mean), or --train-backend fsdp"
            )
        self._init_routing_replay(
            args.num_layers, args.moe_router_topk, args.num_experts, attach_routing_replay
        )
        self.memory_plan = self.check_memory_plan()

    # ------------------------------------------------------------------------------------------------ build
    def _load_module(self, path: str, role: str | None = None, step: int | None = None):
        """A GPTModel (for ``role``, default this trainer's) with weights from an HF dir or a torch_dist
        checkpoint dir (its iteration ``step``, default the latest)."""
        if self.args.custom_model_provider_path:  # slime's hook: it must keep vime's packed attention
            provider = load_hook(self.args.custom_model_provider_path, "--custom-model-provider-path")
            module = provider(
                pre_process=parallel_state.is_pipeline_first_stage(),
                post_process=parallel_state.is_pipeline_last_stage(),
                vp_stage=None,
            )
        else:
            module = build_gpt_model(self.args, self.hf_vocab_size, self.config)
        if (role or self.role) == "critic":
            add_value_head(module, self.config, self.args.seed)
        self._load_module_weights(module, path, step)
        return module

    def _load_module_weights(self, module, path: str, step: int | None) -> None:
        """``module``'s weights from a torch_dist checkpoint directory (its iteration ``step``, default the latest) or
        an HF directory."""
        if step is not None or checkpoint.latest_iteration(path) is not None:
            checkpoint.load(path, step, module, None, None, load_rng=False)
        else:
            weights.load_hf_weights(module, path, self.hf_vocab_size)

    def _frozen(self, path: str, step: int | None = None):
        module = self._load_module(path, "actor", step)
        module.eval()
        module.requires_grad_(False)
        return module

    def _scheduler(self, lr: float) -> OptimizerParamScheduler:
        args = self.args
        total = args.num_rollout * args.num_steps_per_rollout if args.num_rollout else None
        decay = args.lr_decay_iters or total or 1
        warmup = args.lr_warmup_iters
        if args.lr_warmup_fraction is not None:
            warmup = int(args.lr_warmup_fraction * decay)
        return OptimizerParamScheduler(
            self.optimizer,
            init_lr=args.lr_warmup_init,
            max_lr=lr,
            min_lr=args.min_lr,
            lr_warmup_steps=warmup,
            lr_decay_steps=max(decay, warmup + 1) if args.lr_decay_style != "constant" else max(decay, 1),
            lr_decay_style=args.lr_decay_style,
            start_wd=args.weight_decay,
            end_wd=args.weight_decay,
            wd_incr_steps=max(decay, 1),
            wd_incr_style="constant",
        )

    # ---------------------------------------------------------------------------------------- checkpoints
    def _load_checkpoint(self, load_dir: str, step: int, optimizer: Any | None, load_rng: bool) -> dict:
        return checkpoint.load(load_dir, step, self.module, optimizer, self.scheduler, load_rng=load_rng)

    def _load_weights(self, path: str, step: int | None) -> None:
        self._load_module_weights(self.module, path, step)
        if hasattr(self.optimizer, "reload_model_params"):  # refresh the fp32 main copies
            self.optimizer.reload_model_params()

    def _save_checkpoint(self, save_dir: str, rollout_id: int, optimizer: Any | None) -> None:
        checkpoint.save(save_dir, rollout_id, self.module, optimizer, self.scheduler, self.step)

    def export_hf(self, out_dir: str) -> None:
        checkpoint.export_hf(self.module, out_dir, self.args.hf_checkpoint, self.hf_vocab_size, self.dtype)

    def _gpu_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        modules = [
            m
            for m in (self.module, self.ref_model, self.teacher_model, self.old_actor_model)
            if m is not None
        ]
        params = [p for m in modules for p in m.parameters()]
        grad_buffers = [b.grad_data for b in (*self.model.buffers, *self.model.expert_parallel_buffers)]
        main_grads = [getattr(p, "main_grad", None) for p in params]
        return params + optimizer_tensors(self.optimizer), grad_buffers + main_grads

    def iter_weight_buckets(self, buffer_bytes: int, stack_experts: bool = False) -> Iterator[Bucket]:
        """Gathered over TP/PP/EP."""
        return weights.iter_weight_buckets(
            self.module, self.hf_vocab_size, buffer_bytes, self.dtype, stack_experts
        )

    # ------------------------------------------------------------------------------------------ forward only
    def _model_batch(self, packed: PackedBatch, **extra) -> dict:
        """A packed micro-batch as this rank feeds it to the model: padded and split for SP/CP
        (:class:`PackedLayout`), with the local logit rows and their labels."""
        layout = PackedLayout.for_parallelism(
            packed.total_lengths,
            parallel_state.get_tensor_model_parallel_world_size(),
            self.config.sequence_parallel,
            parallel_state.get_context_parallel_world_size(),
            parallel_state.get_context_parallel_rank(),
            "cuda",
            self.args.data_pad_size_multiplier,
        )
        rows, order = layout.logit_rows(packed.logit_indices())
        local = layout.local_positions
        return dict(
            packed=packed,
            layout=layout,
            input_ids=layout.pad(packed.input_ids.cuda(non_blocking=True))[local],
            position_ids=layout.pad(packed.position_ids.cuda(non_blocking=True))[local],
            params=packed_seq_params(layout),
            rows=rows,
            labels=layout.labels(packed.input_ids, rows),
            order=order,
            routing=local_routing(layout, packed.routing, self.config.sequence_parallel),
            **extra,
        )

    def _forward_step(self, loss_func: Callable, data_iterator, model):
        """Megatron schedule callback: forward one packed micro-batch; outputs (logits, or the critic's values)
        only at the rows that predict response tokens."""
        mb = next(data_iterator)
        if self.routing is not None and self.routing.replay.mode is not ReplayMode.OFF:
            self.routing.replay.push(mb["routing"])

        def select_outputs(hidden_states, output_layer, output_weight, **_):
            if self.config.sequence_parallel:
                # Every TP rank holds a slice of the rows: gather them, then select. Both heads below give every TP
                # rank the full input gradient, so the gather's backward only keeps this rank's slice.
                hidden_states = gather_from_sequence_parallel_region(
                    hidden_states, tensor_parallel_output_grad=False
                )
            rows = hidden_states.index_select(0, mb["rows"])
            if self.role == "critic":
                return self.module.value_head(rows)[:, 0, 0]  # replicated over TP: identical gradients
            sequence_parallel, output_layer.sequence_parallel = output_layer.sequence_parallel, False
            try:  # without its sequence-parallel gather the layer all-reduces its input gradient over TP
                logits, _ = output_layer(rows, weight=output_weight)
            finally:
                output_layer.sequence_parallel = sequence_parallel
            return logits[:, 0, :]

        output = model(
            mb["input_ids"].unsqueeze(0),
            mb["position_ids"].unsqueeze(0),
            None,
            packed_seq_params=mb["params"],
            output_processor=select_outputs,
        )
        return output, partial(loss_func, mb)

    def _in_order(self, mb: dict, rows: torch.Tensor) -> torch.Tensor:
        """This rank's per-row results -> the micro-batch's, in order. With CP each rank has its own rows; they are
        all-gathered, every CP rank computes the same loss, and the gather's backward keeps this rank's rows."""
        if mb["order"] is None:
            return rows
        group = parallel_state.get_context_parallel_group()
        return gather_from_sequence_parallel_region(rows, False, group).index_select(0, mb["order"])

    def _token_outputs(
        self, mb: dict, output: torch.Tensor, with_entropy: bool = False, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per response token of the micro-batch, in order: fp32 log-probs (and entropy) from the logits, or the
        critic's values (and None)."""
        if self.role == "critic":
            return self._in_order(mb, output.float()), None
        log_probs, entropy = vocab_parallel_log_probs(
            output,
            mb["labels"],
            self.args.rollout_temperature,
            self.hf_vocab_size,
            with_entropy,
            entropy_grad,
            self.args.log_probs_chunk_size,
        )
        return self._in_order(mb, log_probs), (self._in_order(mb, entropy) if entropy is not None else None)

    def _run_schedule(self, model, mbs: list[dict], loss_func: Callable, forward_only: bool) -> None:
        get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, loss_func),
            data_iterator=iter(mbs),
            model=[model],
            num_microbatches=len(mbs),
            seq_length=max(len(mb["input_ids"]) for mb in mbs),
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def _forward(
        self, model, samples: list[Sample], name: str, with_entropy: bool = False
    ) -> tuple[PerSample, PerSample | None]:
        """Per-sample outputs of ``model`` (``name``: "actor", "ref", "teacher", "old_actor" or "critic") and, with
        ``with_entropy``, the entropies; its MoE routers replay or record as the routing plan says."""
        out: PerSample = [torch.empty(0)] * len(samples)
        entropies: PerSample = [torch.empty(0)] * len(samples)
        with_entropy = with_entropy and self.role != "critic"
        mode, routes = self._pass_routing(name, samples)
        mbs = [
            self._model_batch(
                pack_samples([samples[i] for i in mb], [routes[i] for i in mb] if routes else None),
                indices=mb,
            )
            for mb in self._micro_batches(samples, forward_only=True)
        ]

        def collect(mb, output):
            per_token, entropy = self._token_outputs(mb, output, with_entropy)
            lengths = mb["packed"].response_lengths
            for i, piece in zip(mb["indices"], per_token.split(lengths), strict=True):
                out[i] = piece.float()
            if entropy is not None:
                for i, piece in zip(mb["indices"], entropy.split(lengths), strict=True):
                    entropies[i] = piece.float()
            return torch.zeros((), device="cuda"), torch.zeros((), dtype=torch.int, device="cuda"), {}

        # eval mode: no dropout anyway, and Megatron's MoE refuses TP without sequence parallelism only in training
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), self._routing_pass(mode) as replay:
                self._run_schedule(model, mbs, collect, forward_only=True)
                if mode is ReplayMode.RECORD:
                    for mb, experts in zip(mbs, replay.recorded(), strict=True):
                        full = full_row_routing(mb["layout"], experts, self.config.sequence_parallel)
                        routes = split_routing(full, mb["packed"].total_lengths)
                        self.routing.store([samples[i] for i in mb["indices"]], routes)
        finally:
            model.train(was_training)
        cpu = [t.cpu() for t in self._from_last_stage(out)]
        return cpu, ([t.cpu() for t in self._from_last_stage(entropies)] if with_entropy else None)

    def _from_last_stage(self, out: PerSample) -> PerSample:
        """Per-sample results live on the last pipeline stage; give every stage a copy."""
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return out
        payload = [[t.cpu() for t in out] if parallel_state.is_pipeline_last_stage() else None]
        src = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(payload, src=src, group=parallel_state.get_pipeline_model_parallel_group())
        return payload[0]

    def _memory_probe(self, samples: list[Sample]) -> None:
        entropy_grad = self._entropy_needs_grad()

        def loss_func(mb, output):
            per_token, entropy = self._token_outputs(mb, output, self.role == "actor", entropy_grad)
            loss = per_token.sum() + (entropy.sum() if entropy is not None and entropy_grad else 0.0)
            return loss * 0.0, torch.ones((), dtype=torch.int, device="cuda"), {}

        self.model.train()
        self.model.zero_grad_buffer()
        mb = self._model_batch(pack_samples(samples), indices=list(range(len(samples))))
        self._run_schedule(self.model, [mb], loss_func, forward_only=False)
        self.model.zero_grad_buffer()

    # ------------------------------------------------------------------------------------------------ train
    def _train_step(
        self, samples: list[Sample], masks: PerSample, data: dict[str, PerSample | None]
    ) -> dict[str, float]:
        """One optimizer step over micro-batches through Megatron's schedule (PP-aware)."""
        args = self.args
        start = time.perf_counter()
        inputs, total_tokens = self._micro_batch_inputs(samples, masks, data, self.device)
        mbs = [self._model_batch(packed, indices=mb, batch=batch) for mb, packed, batch in inputs]
        sums: dict[str, torch.Tensor | float] = {}
        entropy_grad = self._entropy_needs_grad()

        def loss_func(mb, output):
            if self.role == "critic":
                values, _ = self._token_outputs(mb, output)
                loss, metrics = value_loss(args, mb["batch"], values)
            else:

                def loss_of(output: torch.Tensor) -> tuple:
                    log_probs, entropy = self._token_outputs(mb, output, True, entropy_grad)
                    return self.loss_fn(args, mb["batch"], log_probs, entropy)

                # --recompute-loss-function: keep only the logits for backward, recompute the rest from them
                recompute = args.recompute_loss_function
                loss, metrics = (
                    torch.utils.checkpoint.checkpoint(loss_of, output, use_reentrant=False)
                    if recompute
                    else loss_of(output)
                )
            add_metrics(sums, metrics)
            return loss, torch.ones((), dtype=torch.int, device="cuda"), {}

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        with self._routing_pass(ReplayMode.REPLAY if self.routing else ReplayMode.OFF):
            self._run_schedule(self.model, mbs, loss_func, forward_only=False)
        finalize_model_grads([self.model])
        lr = self.optimizer.param_groups[0]["lr"]
        success, grad_norm, _ = self.optimizer.step()
        if not success:
            raise RuntimeError("the Megatron optimizer step failed (inf/nan gradients)")
        self.scheduler.step(increment=1)
        self.step += 1
        # metrics exist on the last pipeline stage; summed over data-parallel ranks there
        metrics = metric_sums(sums, self.dp)
        elapsed = time.perf_counter() - start
        metrics.update(
            grad_norm=float(grad_norm or 0.0), lr=lr, step_time_s=elapsed, tokens_per_s=total_tokens / elapsed
        )
        return metrics
