"""HF <-> Megatron-Core parameter names and tensor layouts (Qwen3 dense/MoE, Qwen2.5, Llama 3, GLM-4.5 and, with
multi-latent attention, DeepSeek-V3 / Kimi-K2 style models).

Pure tensor code, no Megatron import, so CPU CI tests it. Names here are *canonical* Megatron names of the
local (non-TransformerEngine) layer spec, with **global** layer and expert indices, e.g.
``decoder.layers.7.mlp.experts.local_experts.12.linear_fc1.weight``; ``weights.py`` turns a rank's local
names (pipeline stage, expert-parallel rank) into these.

Layouts (full, unsharded tensors):
- ``linear_qkv``: rows grouped by query group ``g``: ``[q heads of g (heads/groups * head_dim), k_g, v_g]``,
  groups one after another. Splitting this tensor row-wise into TP chunks gives each rank its whole groups.
- ``linear_fc1`` (SwiGLU): ``[gate; up]``. Under TP each rank holds ``[gate_r; up_r]``, so TP shards are
  built from the halves (:func:`shard_fc1`), never by cutting the fused tensor.
- Multi-latent attention (``mla``): every projection is one HF tensor as is. The up-projections hold whole heads
  (``[nope, rope]`` per query head, ``[nope, v]`` per key/value head) in HF's order, so TP row chunks are whole heads;
  the down-projection's ``[kv_lora_rank, rope]`` rows are Megatron's split too.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from vime.utils.stacked_experts import W2, W13, stacked_name
from vime.utils.weight_buckets import StackedTensor

# kinds of mapping
PLAIN, QKV, FC1 = "plain", "qkv", "fc1"


@dataclass(frozen=True)
class AttentionShape:
    """What the qkv layout depends on."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int

    def __post_init__(self):
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of num_query_groups="
                f"{self.num_query_groups}"
            )


# (megatron suffix, hf suffixes, kind), for the part of the name after ``decoder.layers.{i}.`` /
# ``model.layers.{i}.``; ``{e}`` is the (global) expert index.
_LAYER_RULES: list[tuple[str, list[str], str]] = [
    ("input_layernorm.weight", ["input_layernorm.weight"], PLAIN),
    (
        "self_attention.linear_qkv.weight",
        ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
        QKV,
    ),
    (
        "self_attention.linear_qkv.bias",
        ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
        QKV,
    ),
    ("self_attention.q_layernorm.weight", ["self_attn.q_norm.weight"], PLAIN),
    ("self_attention.k_layernorm.weight", ["self_attn.k_norm.weight"], PLAIN),
    ("self_attention.linear_proj.weight", ["self_attn.o_proj.weight"], PLAIN),
    ("pre_mlp_layernorm.weight", ["post_attention_layernorm.weight"], PLAIN),
    ("mlp.linear_fc1.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], FC1),
    ("mlp.linear_fc2.weight", ["mlp.down_proj.weight"], PLAIN),
    ("mlp.router.weight", ["mlp.gate.weight"], PLAIN),
    ("mlp.router.expert_bias", ["mlp.gate.e_score_correction_bias"], PLAIN),
    (
        "mlp.experts.local_experts.{e}.linear_fc1.weight",
        ["mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"],
        FC1,
    ),
    ("mlp.experts.local_experts.{e}.linear_fc2.weight", ["mlp.experts.{e}.down_proj.weight"], PLAIN),
    (
        "mlp.shared_experts.linear_fc1.weight",
        ["mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"],
        FC1,
    ),
    ("mlp.shared_experts.linear_fc2.weight", ["mlp.shared_experts.down_proj.weight"], PLAIN),
]
# multi-latent attention, ahead of the rules above (q_layernorm is the query latent's norm there)
_MLA_RULES: list[tuple[str, list[str], str]] = [
    ("self_attention.linear_q_proj.weight", ["self_attn.q_proj.weight"], PLAIN),  # no query compression
    ("self_attention.linear_q_down_proj.weight", ["self_attn.q_a_proj.weight"], PLAIN),
    ("self_attention.q_layernorm.weight", ["self_attn.q_a_layernorm.weight"], PLAIN),
    ("self_attention.linear_q_up_proj.weight", ["self_attn.q_b_proj.weight"], PLAIN),
    ("self_attention.linear_kv_down_proj.weight", ["self_attn.kv_a_proj_with_mqa.weight"], PLAIN),
    ("self_attention.kv_layernorm.weight", ["self_attn.kv_a_layernorm.weight"], PLAIN),
    ("self_attention.linear_kv_up_proj.weight", ["self_attn.kv_b_proj.weight"], PLAIN),
]
_TOP_RULES: list[tuple[str, list[str], str]] = [
    ("embedding.word_embeddings.weight", ["model.embed_tokens.weight"], PLAIN),
    ("decoder.final_layernorm.weight", ["model.norm.weight"], PLAIN),
    ("output_layer.weight", ["lm_head.weight"], PLAIN),
    # the critic's value head, named like transformers' token classifier (what the FSDP critic is)
    ("value_head.weight", ["score.weight"], PLAIN),
    ("value_head.bias", ["score.bias"], PLAIN),
]
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"local_experts\.(\d+)\.")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"experts\.(\d+)\.")
_EXPERT_WEIGHT = re.compile(
    r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$"
)

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _layer_rules(mla: bool) -> list[tuple[str, list[str], str]]:
    return _MLA_RULES + _LAYER_RULES if mla else _LAYER_RULES


def hf_names(mcore_name: str, mla: bool = False) -> tuple[list[str], str]:
    """The HF names of a canonical Megatron parameter and the kind of mapping (``plain``, ``qkv``, ``fc1``);
    ``mla``: the model has multi-latent attention."""
    for suffix, hf, kind in _TOP_RULES:
        if mcore_name == suffix:
            return list(hf), kind
    match = _LAYER.match(mcore_name)
    if match:
        layer, rest = match.groups()
        expert = _EXPERT.search(rest)
        key = _EXPERT.sub("local_experts.{e}.", rest) if expert else rest
        for suffix, hf, kind in _layer_rules(mla):
            if key == suffix:
                names = [h.format(e=expert.group(1)) if expert else h for h in hf]
                return [f"model.layers.{layer}.{n}" for n in names], kind
    raise KeyError(f"no HF name for Megatron parameter {mcore_name!r} (hf_mapping._LAYER_RULES)")


def mcore_name(hf_name: str, mla: bool = False) -> str:
    """The canonical Megatron name that holds HF tensor ``hf_name`` (several HF tensors share a fused one)."""
    for suffix, hf, _ in _TOP_RULES:
        if hf_name in hf:
            return suffix
    match = _HF_LAYER.match(hf_name)
    if match:
        layer, rest = match.groups()
        expert = _HF_EXPERT.search(rest) if rest.startswith("mlp.experts.") else None
        key = _HF_EXPERT.sub("experts.{e}.", rest, count=1) if expert else rest
        for suffix, hf, _ in _layer_rules(mla):
            if key in hf:
                return f"decoder.layers.{layer}.{suffix.format(e=expert.group(1)) if expert else suffix}"
    raise KeyError(f"no Megatron parameter for HF tensor {hf_name!r} (hf_mapping._LAYER_RULES)")


# ------------------------------------------------------------------------------------------------- layouts
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: AttentionShape) -> torch.Tensor:
    """HF ``q_proj/k_proj/v_proj`` (weights ``[out, in]`` or biases ``[out]``) -> Megatron ``linear_qkv``."""
    groups, d = shape.num_query_groups, shape.head_dim
    per_group = shape.num_attention_heads // groups
    rest = q.shape[1:]
    q = q.reshape(groups, per_group * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, shape: AttentionShape) -> list[torch.Tensor]:
    """Megatron ``linear_qkv`` -> HF ``[q, k, v]`` (inverse of :func:`fuse_qkv`)."""
    groups, d = shape.num_query_groups, shape.head_dim
    per_group = shape.num_attention_heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per_group + 2) * d, *rest)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def fuse_fc1(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF ``gate_proj``, ``up_proj`` -> full Megatron SwiGLU ``linear_fc1`` ``[gate; up]``."""
    return torch.cat([gate, up], dim=0)


def split_fc1(fc1: torch.Tensor) -> list[torch.Tensor]:
    """Full ``linear_fc1`` -> HF ``[gate, up]``."""
    gate, up = fc1.chunk(2, dim=0)
    return [gate.contiguous(), up.contiguous()]


def to_mcore(kind: str, tensors: list[torch.Tensor], shape: AttentionShape) -> torch.Tensor:
    """The full Megatron tensor from its HF tensors."""
    if kind == QKV:
        return fuse_qkv(*tensors, shape)
    if kind == FC1:
        return fuse_fc1(*tensors)
    (tensor,) = tensors
    return tensor


def to_hf(kind: str, tensor: torch.Tensor, shape: AttentionShape) -> list[torch.Tensor]:
    """The HF tensors (in :func:`hf_names` order) of a full Megatron tensor."""
    if kind == QKV:
        return split_qkv(tensor, shape)
    if kind == FC1:
        return split_fc1(tensor)
    return [tensor]


def stack_experts(
    full: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor | StackedTensor]]:
    """Canonical ``(name, full tensor)`` pairs, each layer's routed experts consecutive, with those experts replaced
    by two stacked entries (:mod:`vime.utils.stacked_experts`): ``w13`` (every expert's ``linear_fc1``, which is
    ``[gate; up]``) and ``w2`` (every ``linear_fc2``). Other pairs pass through."""

    def layer_of(item: tuple[str, torch.Tensor]) -> int | None:
        match = _EXPERT_WEIGHT.match(item[0])
        return int(match.group(1)) if match else None

    for layer, group in itertools.groupby(full, key=layer_of):
        if layer is None:
            yield from group
            continue
        fc: dict[str, dict[int, torch.Tensor]] = {"1": {}, "2": {}}
        for name, tensor in group:
            _, expert, which = _EXPERT_WEIGHT.match(name).groups()
            fc[which][int(expert)] = tensor
        experts = range(len(fc["1"]))
        if sorted(fc["1"]) != list(experts) or sorted(fc["2"]) != list(experts):
            raise ValueError(
                f"layer {layer}: expert weights to stack must cover experts 0..E-1 for linear_fc1 and linear_fc2, "
                f"got {sorted(fc['1'])} and {sorted(fc['2'])}"
            )
        prefix = f"model.layers.{layer}.mlp.experts"
        yield stacked_name(prefix, W13), StackedTensor([fc["1"][e] for e in experts])
        yield stacked_name(prefix, W2), StackedTensor([fc["2"][e] for e in experts])


# -------------------------------------------------------------------------------------- tensor parallelism
def shard(kind: str, full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """This TP rank's shard of a full Megatron tensor split along ``dim`` (fc1: ``[gate_r; up_r]``)."""
    if size == 1:
        return full
    if full.shape[dim] % size:
        raise ValueError(f"dimension {dim} of shape {tuple(full.shape)} does not split into {size} TP ranks")
    if kind == FC1 and dim == 0:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], dim=0)
    return full.chunk(size, dim=dim)[rank].contiguous()


def unshard(kind: str, shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of :func:`shard`: the full tensor from every TP rank's shard, in rank order."""
    if len(shards) == 1:
        return shards[0]
    if kind == FC1 and dim == 0:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def pad_vocab(tensor: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """Zero rows appended to an embedding / output matrix up to Megatron's padded vocabulary size."""
    extra = padded_vocab_size - tensor.shape[0]
    if extra < 0:
        raise ValueError(f"HF vocab {tensor.shape[0]} exceeds Megatron's padded vocab {padded_vocab_size}")
    if extra == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])], dim=0)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron's rule: round the vocab up to a multiple of ``--make-vocab-size-divisible-by`` x TP."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple
