"""``--moe-grouped-gemm`` without TransformerEngine: a MoE layer's local experts as two grouped GEMMs.

Megatron-Core's grouped-GEMM experts need TransformerEngine; its local fallback, ``SequentialMLP``, runs one small
GEMM pair per expert (128 experts: 384 kernel launches per layer and pass, each on a few dozen tokens).
:class:`GroupedGemmExperts` keeps ``SequentialMLP``'s parameters (names, shapes, checkpoints, weight sync are
unchanged) and computes all experts at once with ``torch.nn.functional.grouped_mm`` over the per-expert weights
stacked for the pass (:func:`~vime.backends.megatron_utils.grouped_linear.grouped_linear`: one grouped GEMM per
projection forward, two backward, the weight gradients accumulated into Megatron DDP's ``main_grad`` in a few
launches). Where grouped GEMM does not apply (not CUDA bf16, a single local expert, expert tensor
parallelism; checked per forward) it runs ``SequentialMLP``'s loop.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from vime.backends.megatron_utils.grouped_linear import grouped_linear, grouped_mm


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
    if problems:
        raise ValueError(
            "--moe-grouped-gemm (vime's torch grouped-GEMM experts) does not support "
            + ", ".join(problems)
            + "; drop --moe-grouped-gemm to run the experts one by one"
        )


class GroupedGemmExperts(SequentialMLP):
    """``SequentialMLP`` with its experts computed by two grouped GEMMs (see the module docstring)."""

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
    ):
        hidden = permuted_local_hidden_states
        if not self._grouped(hidden):
            return super().forward(hidden, tokens_per_expert, permuted_probs)
        # the dispatchers hand the counts over on the host: sum them there, then one copy without a stream sync
        ends = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32).to(hidden.device, non_blocking=True)
        fc1 = [expert.linear_fc1.weight for expert in self.local_experts]  # each [ffn (x2 gated), hidden]
        fc2 = [expert.linear_fc2.weight for expert in self.local_experts]  # each [hidden, ffn]
        intermediate = self._activate(grouped_linear(hidden, fc1, ends), permuted_probs)
        return grouped_linear(intermediate, fc2, ends), None

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
