"""``--moe-grouped-gemm`` without TransformerEngine: a MoE layer's local experts as stacked weights and two grouped
GEMMs.

Megatron-Core's grouped-GEMM experts need TransformerEngine; its local fallback, ``SequentialMLP``, keeps one weight
per expert and projection and runs one small GEMM pair per expert. :class:`GroupedGemmExperts` holds each
projection of all local experts as one parameter, ``stacked_fc1_weight`` ``[E, ffn (x2 gated), hidden]`` and
``stacked_fc2_weight`` ``[E, hidden, ffn]`` (expert ``e``'s ``SequentialMLP`` weight is row ``e``), and computes
them with ``torch.nn.functional.grouped_mm`` (:func:`~vime.backends.megatron_utils.grouped_linear.grouped_linear`):
no per-pass stacking, one weight gradient, one ``main_grad`` add and one DDP hook per projection. Where grouped
GEMM does not apply (not CUDA bf16, a single local expert, expert tensor parallelism; checked per forward) it
loops over the experts with ``F.linear`` on rows of the stacked weights.

Outside this module the experts stay ``SequentialMLP``'s: :func:`per_expert` names rows of a stacked tensor as
``local_experts.{e}.linear_fc{1,2}.weight`` (HF mapping, weight sync), and :meth:`GroupedGemmExperts.sharded_state_dict`
writes the ``torch_dist`` keys, global shapes and offsets ``SequentialMLP`` writes, so checkpoints load either way.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_object_for_checkpoint,
)

from vime.backends.megatron_utils.grouped_linear import grouped_linear, grouped_mm

# stacked parameter -> the per-expert linear of SequentialMLP's MLP it stacks
STACKED = {"stacked_fc1_weight": "linear_fc1", "stacked_fc2_weight": "linear_fc2"}
# what Megatron's linears mark their weights with for tensor and expert parallelism (``allreduce=False``: reduced
# over the expert-data-parallel group, and an expert parameter to the optimizer's grad norm)
_PARALLEL_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce")


def check_grouped_gemm_config(config: TransformerConfig) -> None:
    """Refuse ``--moe-grouped-gemm`` for expert layouts the grouped path does not compute."""
    problems = []
    if grouped_mm is None:
        problems.append(f"torch {torch.__version__} has no grouped_mm (torch >= 2.8 on Hopper or newer)")
    if config.add_bias_linear:
        problems.append("expert biases (--add-bias-linear)")
    if config.moe_apply_probs_on_input:
        problems.append("--moe-apply-probs-on-input")
    if getattr(config, "activation_func_clamp_value", None) is not None:
        problems.append("a clamped activation")
    if config.delay_wgrad_compute:
        problems.append("--delay-wgrad-compute")
    if problems:
        raise ValueError(
            "--moe-grouped-gemm (vime's torch grouped-GEMM experts) does not support "
            + ", ".join(problems)
            + "; drop --moe-grouped-gemm to run the experts one by one"
        )


class GroupedGemmExperts(MegatronModule):
    """A MoE layer's local experts as two stacked weights (see the module docstring); built with ``SequentialMLP``'s
    arguments, and initialised as ``SequentialMLP`` initialises its experts."""

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        pg_collection=None,
        name: str | None = None,
    ):
        experts = SequentialMLP(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
        super().__init__(config=experts.config)
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = experts.ep_group, experts.tp_group, experts.dp_group
        for stacked, linear in STACKED.items():
            setattr(self, stacked, _stack([getattr(e, linear).weight for e in experts.local_experts]))

    def _grouped(self, hidden: torch.Tensor) -> bool:
        return (
            hidden.is_cuda
            and hidden.dtype == torch.bfloat16
            and self.num_local_experts > 1
            and self.tp_group.size() == 1
        )

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        hidden, probs = permuted_local_hidden_states, permuted_probs
        fc1, fc2 = self.stacked_fc1_weight, self.stacked_fc2_weight
        if self._grouped(hidden):
            # the dispatchers hand the counts over on the host: sum them there, then one copy without a stream sync
            ends = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32).to(hidden.device, non_blocking=True)
            return grouped_linear(self._activate(grouped_linear(hidden, fc1, ends), probs), fc2, ends), None
        counts = tokens_per_expert.tolist()
        # unbind: one backward node stacks the experts' gradients (indexing would add a full-size one per expert)
        pieces = zip(hidden.split(counts), probs.split(counts), fc1.unbind(0), fc2.unbind(0), strict=True)
        return torch.cat([F.linear(self._activate(F.linear(x, w1), p), w2) for x, p, w1, w2 in pieces]), None

    def _activate(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The expert MLP's activation, each token scaled by its routing probability (as ``MLP`` does)."""
        config = self.config
        if config.gated_linear_unit and config.activation_func is F.silu and config.bias_activation_fusion:
            return weighted_bias_swiglu_impl(x, None, probs.unsqueeze(-1))
        if config.gated_linear_unit:
            gate, linear = torch.chunk(x, 2, dim=-1)
            x = config.activation_func(gate) * (linear + config.glu_linear_offset)
        else:
            x = config.activation_func(x)
        return (x * probs.unsqueeze(-1)).to(x.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """``SequentialMLP``'s ``torch_dist`` entries (keys ``{prefix}experts.linear_fc{1,2}.weight`` over all
        experts, gated ``linear_fc1`` as its gate and up halves, the linears' empty extra states), each stacked
        weight as one shard of this rank's experts. The entries hold the parameters themselves, so the optimizer's
        state maps onto them (and loads either way too)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        if metadata.get("singleton_local_shards", False):
            raise ValueError("--moe-grouped-gemm: singleton_local_shards checkpoints are not supported")
        axis = len(sharded_offsets)  # the experts' axis, where SequentialMLP prepends it
        ep_rank, ep_size = self.ep_group.rank(), self.ep_group.size()
        tp_rank, tp_size = self.tp_group.rank(), self.tp_group.size()
        replica_id = (0, 0, self.dp_group.rank())

        def shard(key: str, data: torch.Tensor, *offsets: tuple[int, int, int]) -> ShardedTensor:
            return ShardedTensor.from_rank_offsets(
                key, data, *sharded_offsets, (axis, ep_rank, ep_size), *offsets,
                replica_id=replica_id, prepend_axis_num=axis,
            )  # fmt: skip

        fc1_key = f"{prefix}experts.linear_fc1.weight"
        fc1 = self.stacked_fc1_weight
        if self.config.gated_linear_unit:

            @torch.no_grad()
            def halves(key, data, replica, flattened_range):
                # the checkpoint holds [gate of all TP ranks; up of all TP ranks], as Megatron's swiglu factory
                gate, up = torch.chunk(data, 2, dim=1)
                return [
                    shard(key, gate, (axis + 1, tp_rank, 2 * tp_size)),
                    shard(key, up, (axis + 1, tp_size + tp_rank, 2 * tp_size)),
                ]

            fc1_entry = ShardedTensorFactory(fc1_key, fc1, halves, partial(torch.cat, dim=1), replica_id)
        else:
            fc1_entry = shard(fc1_key, fc1, (axis + 1, tp_rank, tp_size))
        state = {
            f"{prefix}stacked_fc1_weight": fc1_entry,
            f"{prefix}stacked_fc2_weight": shard(
                f"{prefix}experts.linear_fc2.weight", self.stacked_fc2_weight, (axis + 2, tp_rank, tp_size)
            ),
        }
        num_experts = ep_size * self.num_local_experts
        extra_replica_id = (0, tp_rank, replica_id[2])
        for e in range(self.num_local_experts):
            expert = (*sharded_offsets, (axis, ep_rank * self.num_local_experts + e, num_experts))
            for linear in STACKED.values():
                key = f"{prefix}experts.{linear}._extra_state"
                state[f"{prefix}local_experts.{e}.{linear}._extra_state"] = (
                    make_sharded_object_for_checkpoint(None, key, expert, replica_id=extra_replica_id)
                )
        return state


def _stack(weights: list[torch.nn.Parameter]) -> torch.nn.Parameter:
    """One parameter ``[E, *shape]`` of the experts' weights, with their Megatron attributes (tensor and expert
    parallelism: ``allreduce``, ``tensor_model_parallel``, ...), its ``partition_dim`` shifted past the experts."""
    stacked = torch.nn.Parameter(torch.stack([w.detach() for w in weights]))
    _copy_parallel_attrs(weights[0], stacked, 1)
    return stacked


def _copy_parallel_attrs(source: torch.Tensor, target: torch.Tensor, shift: int) -> None:
    for attr in _PARALLEL_ATTRS:
        if hasattr(source, attr):
            setattr(target, attr, getattr(source, attr) + (shift if attr == "partition_dim" else 0))


def per_expert(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` as ``SequentialMLP`` names it: a stacked expert weight (or its ``main_grad``, ...) of
    :class:`GroupedGemmExperts` as one detached view per local expert, ``...experts.local_experts.{e}.linear_fc1.weight``
    etc., carrying the per-expert Megatron attributes; any other tensor as it is."""
    module, dot, attr = name.rpartition(".")
    linear = STACKED.get(attr)
    if linear is None:
        return [(name, tensor)]
    views = []
    for e, view in enumerate(tensor.detach().unbind(0)):
        _copy_parallel_attrs(tensor, view, -1)
        views.append((f"{module}{dot}local_experts.{e}.{linear}.weight", view))
    return views


def per_expert_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.named_parameters()`` with every stacked expert weight as :func:`per_expert` views: the names and
    tensors a model of ``SequentialMLP`` experts has."""
    for name, param in model.named_parameters():
        yield from per_expert(name, param)


def check_expert_patterns(model: torch.nn.Module, patterns: dict[str, list[str] | None]) -> None:
    """Refuse a ``--freeze-params-name-list`` / ``--only-train-params-name-list`` pattern (``patterns``: flag ->
    patterns) that names single experts of stacked weights: it matches ``SequentialMLP``'s per-expert names but no
    parameter, and a stacked weight trains or freezes as a whole."""
    real = [name for name, _ in model.named_parameters()]
    views = [name for name, _ in per_expert_parameters(model)]
    for flag, flag_patterns in patterns.items():
        for pattern in flag_patterns or []:
            if not any(re.search(pattern, n) for n in real) and any(re.search(pattern, n) for n in views):
                raise ValueError(
                    f"{flag} {pattern!r} names single experts, but --moe-grouped-gemm keeps each layer's experts "
                    "as two stacked parameters (...mlp.experts.stacked_fc1_weight, stacked_fc2_weight) that "
                    "train or freeze as a whole: match those names to freeze all of a layer's experts, or drop "
                    "--moe-grouped-gemm to freeze experts one by one"
                )


def use_grouped_experts(mlp_spec) -> None:
    """Make a layer's MoE spec (a ``ModuleSpec`` or a ``partial`` of ``MoELayer``) build
    :class:`GroupedGemmExperts` where it would build ``SequentialMLP``; a dense MLP spec is left alone."""
    submodules = getattr(mlp_spec, "submodules", None)
    if submodules is None and isinstance(mlp_spec, partial):
        submodules = mlp_spec.keywords.get("submodules")
    experts = getattr(submodules, "experts", None)
    if isinstance(experts, partial) and experts.func is SequentialMLP:
        submodules.experts = partial(GroupedGemmExperts, *experts.args, **experts.keywords)
    elif isinstance(experts, ModuleSpec) and experts.module is SequentialMLP:
        experts.module = GroupedGemmExperts
