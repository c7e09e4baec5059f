"""Build a Megatron-Core ``GPTModel`` from the Megatron flags, with the local (non-TransformerEngine) layer spec.

TransformerEngine is not a dependency. Its attention is the only one in Megatron-Core that takes packed (THD)
batches or context parallelism, and its norms the only ones that take sequence parallelism, so this module
brings :class:`PackedCoreAttention` (packed, context-parallel attention on FlashAttention-2's varlen kernels,
``vime.utils.varlen_attention``) and :class:`RMSNorm` (sequence-parallel aware).
"""

from __future__ import annotations

import argparse

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from vime.backends.megatron_utils.config import transformer_config_kwargs
from vime.backends.megatron_utils.grouped_experts import check_grouped_gemm_config, use_grouped_experts
from vime.backends.megatron_utils.hf_mapping import padded_vocab_size
from vime.backends.megatron_utils.packed_layout import PackedLayout
from vime.utils.varlen_attention import packed_causal_attention


class PackedCoreAttention(MegatronModule):
    """Causal softmax attention for packed batches laid out by :class:`PackedLayout` (attached to the
    ``PackedSeqParams`` by :func:`packed_seq_params`). Each packed sequence attends only to itself; with context
    parallelism the keys and values of every CP rank are all-gathered first (their gradients reduce-scattered
    back). Grouped-query attention maps query head ``h`` to key/value group ``h // (heads / groups)``.

    The packed row reaches Megatron as one sequence of batch 1 (``sbhd``), so its rotary embedding is applied by
    :class:`PackedRotaryEmbedding` in one pass instead of Megatron's per-sequence THD loop."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        # multi-latent attention passes its own scale (YaRN's mscale) and head sizes (query/key 192, value 128 ...)
        self.softmax_scale = softmax_scale or (k_channels or config.kv_channels) ** -0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        layout = getattr(packed_seq_params, "_vime_layout", None)
        if layout is None or attention_bias is not None:
            raise ValueError("PackedCoreAttention takes packed batches from packed_seq_params() and no bias")
        # [t, 1, heads or groups, d] -> [t, heads or groups, d]; multi-latent attention hands them over as the latter
        query, key, value = (x.squeeze(1) if x.dim() == 4 else x for x in (query, key, value))
        if layout.cp_size > 1:
            group = parallel_state.get_context_parallel_group()
            key, value = (
                gather_from_sequence_parallel_region(x, group=group).index_select(0, layout.gathered_index)
                for x in (key, value)
            )
        out = packed_causal_attention(query, key, value, layout.attention_blocks, self.softmax_scale)
        return out.reshape(out.shape[0], 1, -1)


class PackedRotaryEmbedding(torch.nn.Module):
    """Megatron's rotary embedding (``rotary``) for packed rows: each local token gets the frequencies of its own
    position in its sequence. ``GPTModel`` asks :meth:`get_rotary_seq_len` and hands the answer to
    :meth:`forward`; here that answer is the micro-batch's :class:`PackedLayout`, so the frequencies come out as
    ``[t, 1, 1, dim]`` and attention applies them to the whole row at once."""

    def __init__(self, rotary: torch.nn.Module):
        super().__init__()
        self.rotary = rotary

    def get_rotary_seq_len(
        self,
        inference_context,
        transformer,
        transformer_input,
        transformer_config,
        packed_seq_params=None,
        **_,
    ) -> PackedLayout:
        layout = getattr(packed_seq_params, "_vime_layout", None)
        if layout is None:
            raise ValueError("vime's Megatron models take packed batches from packed_seq_params() only")
        return layout

    def forward(self, layout: PackedLayout, *args, **kwargs) -> torch.Tensor:
        table = self.rotary(
            max(layout.padded_lengths), packed_seq=True
        )  # [positions, 1, 1, dim], every CP rank's
        return table[layout.rope_positions]


class PackedMLARotaryEmbedding(PackedRotaryEmbedding):
    """:class:`PackedRotaryEmbedding` for multi-latent attention, which builds its own rotary embedding (plain or
    YaRN) and applies it to ``[t, heads, dim]`` rows: the frequencies come out as ``[t, 1, dim]``, with YaRN's cos/sin
    scale beside them as the YaRN embedding returns it."""

    def forward(self, layout: PackedLayout, *args, **kwargs) -> torch.Tensor | tuple[torch.Tensor, float]:
        out = self.rotary(max(layout.padded_lengths), packed_seq=True)
        table, mscale = out if isinstance(out, tuple) else (out, None)
        rows = table[layout.rope_positions][:, 0]  # [t, 1, dim]
        return rows if mscale is None else (rows, mscale)


class TensorParallelMLASelfAttention(MLASelfAttention):
    """Multi-latent attention whose shared RoPE key gets its whole gradient under tensor (and sequence) parallelism.

    The local spec's key/value down projection is column-parallel: Megatron-Core gathers its output over TP and then
    splits it, whose backward hands each rank its own columns of the gradient. Every TP rank expands the one RoPE key
    over only its own heads, so the RoPE key's gradient is each rank's part of a sum, and the split drops the other
    ranks' parts (Megatron-LM issue 1699; megatron-core 0.19.2): a TP > 1 step differed from TP = 1. Here the
    gathered projection goes back to Megatron-Core split over the sequence, as a full-width projection's output
    would be; Megatron-Core then gathers the RoPE key over the sequence, and that gather's backward sums its gradient
    over the TP ranks. TP without sequence parallelism is refused (``config.check_mla_tensor_parallelism``)."""

    def _qkv_down_projection(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        if kv_combined.size(-1) == self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim:
            return q_compressed, kv_combined  # one TP rank: nothing split
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined, group=self.tp_group)
        return q_compressed, scatter_to_sequence_parallel_region(kv_combined, group=self.tp_group)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built from Megatron's arguments. With sequence parallelism each TP rank normalises
    different tokens, so the weight is tagged for ``finalize_model_grads`` to sum its gradient over TP."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def packed_seq_params(layout: PackedLayout) -> PackedSeqParams:
    """``PackedSeqParams`` of a packed micro-batch's (padded) sequences, carrying ``layout``. The row is one ``sbhd``
    sequence to Megatron: :class:`PackedCoreAttention` and :class:`PackedRotaryEmbedding` keep the sequences apart."""
    cu = torch.tensor(layout.cu_seqlens, dtype=torch.int32).to(layout.device, non_blocking=True)
    longest = max(layout.padded_lengths)
    params = PackedSeqParams(
        qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    params._vime_layout = layout
    return params


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    """The ``TransformerConfig`` of the Megatron flags (:func:`transformer_config_kwargs`); an
    ``MLATransformerConfig`` with --multi-latent-attention."""
    kwargs = transformer_config_kwargs(args)
    return (MLATransformerConfig if kwargs.get("multi_latent_attention") else TransformerConfig)(**kwargs)


def build_gpt_model(
    args: argparse.Namespace, vocab_size: int, config: TransformerConfig | None = None
) -> GPTModel:
    """This pipeline stage's ``GPTModel`` on the current CUDA device, in the compute dtype; ``vocab_size`` is the
    HF vocabulary (padded to ``--make-vocab-size-divisible-by`` x TP here)."""
    config = config or transformer_config(args)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    spec.layer_norm = RMSNorm
    if getattr(args, "moe_grouped_gemm", False) and args.num_experts:
        check_grouped_gemm_config(config)
    for layer in spec.layer_specs:
        if getattr(args, "moe_grouped_gemm", False):
            use_grouped_experts(layer.submodules.mlp)
        attention = layer.submodules.self_attention.submodules
        attention.core_attention = PackedCoreAttention
        if config.multi_latent_attention:
            if layer.submodules.self_attention.module is MLASelfAttention:
                layer.submodules.self_attention.module = TensorParallelMLASelfAttention
            if (
                config.qk_layernorm
            ):  # the query and key/value latents' norms (no query latent without q_lora_rank)
                attention.q_layernorm = IdentityOp if config.q_lora_rank is None else RMSNorm
                attention.kv_layernorm = RMSNorm
        elif attention.q_layernorm is not IdentityOp:  # Qwen3's per-head q/k norms
            attention.q_layernorm = attention.k_layernorm = RMSNorm
        layer.submodules.input_layernorm = RMSNorm
        layer.submodules.pre_mlp_layernorm = RMSNorm
    position = "rope" if args.use_rotary_position_embeddings else args.position_embedding_type
    tp = parallel_state.get_tensor_model_parallel_world_size()
    padded = padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by, tp)
    if args.padded_vocab_size is not None:  # Megatron's own flag: the size as it is, not rounded
        if args.padded_vocab_size < vocab_size or args.padded_vocab_size % tp:
            raise ValueError(
                f"--padded-vocab-size {args.padded_vocab_size}: at least the HF vocabulary ({vocab_size}) and a "
                f"multiple of the tensor-parallel size ({tp})"
            )
        padded = args.padded_vocab_size
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded,
        max_sequence_length=args.max_position_embeddings or args.seq_length or 4096,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=position,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
    )
    if config.multi_latent_attention:  # each MLA layer has its own rotary embedding
        for layer in model.decoder.layers:
            layer.self_attention.rotary_pos_emb = PackedMLARotaryEmbedding(
                layer.self_attention.rotary_pos_emb
            )
    elif position == "rope":
        model.rotary_pos_emb = PackedRotaryEmbedding(model.rotary_pos_emb)
    model.cuda(torch.cuda.current_device())
    # Parameters only (torch norms are created in fp32); buffers such as the router's expert bias keep theirs.
    for param in model.parameters():
        param.data = param.data.to(config.params_dtype)
    return model


def add_value_head(model: GPTModel, config: TransformerConfig, seed: int) -> None:
    """Make ``model`` a critic: its last pipeline stage gets ``value_head`` (hidden -> 1, with bias, like
    transformers' token classifier), initialised from ``seed`` so every rank starts identical. An untied
    vocabulary output layer is frozen: the critic never uses it."""
    if not model.post_process:
        return
    head = torch.nn.Linear(config.hidden_size, 1)
    with torch.no_grad():
        head.weight.normal_(0.0, config.init_method_std, generator=torch.Generator().manual_seed(seed))
        head.bias.zero_()
    model.value_head = head.to(device=torch.cuda.current_device(), dtype=config.params_dtype)
    if not model.share_embeddings_and_output_weights:
        model.output_layer.requires_grad_(False)
