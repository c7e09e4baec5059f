"""HF safetensors into a (TP/PP/EP-sharded) Megatron ``GPTModel``, and HF-named full tensors out of it.

The name and layout rules are in :mod:`hf_mapping`; this module adds the parallel part: a rank's local names
(its pipeline stage's layers, its expert-parallel rank's experts) to canonical ones, TP shard/gather, and for
export the broadcast of each tensor from the ranks that hold it to every rank.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open

from vime.backends.megatron_utils import hf_mapping
from vime.backends.megatron_utils.grouped_experts import per_expert_parameters
from vime.backends.megatron_utils.hf_mapping import AttentionShape
from vime.utils.weight_buckets import Bucket, StackedTensor, in_buckets

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"local_experts\.(\d+)\.")


@dataclass
class LocalTensor:
    """One tensor of this rank's model and how it maps to HF."""

    local_name: str
    canonical: str
    tensor: torch.Tensor
    kind: str
    hf_names: list[str]
    tp_dim: int | None  # the dimension split over TP ranks, None if replicated
    is_expert: bool

    def tp_group(self):
        if self.is_expert:
            return parallel_state.get_expert_tensor_parallel_group()
        return parallel_state.get_tensor_model_parallel_group()

    def tp_rank_size(self) -> tuple[int, int]:
        if self.tp_dim is None:
            return 0, 1
        if self.is_expert:
            return (
                parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size(),
            )
        return (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
        )


def attention_shape(model) -> AttentionShape:
    config = model.config
    return AttentionShape(config.num_attention_heads, config.num_query_groups, config.kv_channels)


def local_tensors(model) -> list[LocalTensor]:
    """This rank's parameters (and the router's expert-bias buffers) with their canonical names; stacked expert
    weights (``--moe-grouped-gemm``) as per-expert views, named and written as ``SequentialMLP``'s."""
    layer_offset = 0
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if layers is not None and len(layers) > 0:
        layer_offset = layers[0].layer_number - 1
    num_experts = model.config.num_moe_experts or 0
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    expert_offset = (
        parallel_state.get_expert_model_parallel_rank() * (num_experts // ep_size) if num_experts else 0
    )

    def canonical(name: str) -> str:
        name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)
        return _EXPERT.sub(lambda m: f"local_experts.{int(m.group(1)) + expert_offset}.", name)

    mla = model.config.multi_latent_attention
    out = []
    items = list(per_expert_parameters(model)) + [
        (n, b) for n, b in model.named_buffers() if n.endswith("router.expert_bias")
    ]
    for name, tensor in items:
        full_name = canonical(name)
        names, kind = hf_mapping.hf_names(full_name, mla)
        split = getattr(tensor, "tensor_model_parallel", False)
        out.append(
            LocalTensor(
                local_name=name,
                canonical=full_name,
                tensor=tensor,
                kind=kind,
                hf_names=names,
                tp_dim=getattr(tensor, "partition_dim", 0) if split else None,
                is_expert=".local_experts." in name or not getattr(tensor, "allreduce", True),
            )
        )
    return out


# --------------------------------------------------------------------------------------------------- loading
class _SafetensorsDir:
    """Lazy reader of an HF directory of ``*.safetensors`` files (sharded or not)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {self.path} (--hf-checkpoint)")
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.where = {k: self.path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            self.where = {}
            for file in files:
                with safe_open(file, "pt") as handle:
                    self.where.update(dict.fromkeys(handle.keys(), file))
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        file = self.where[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, "pt")
        return self._handles[file].get_tensor(name)


def load_hf_weights(model, hf_dir: str | Path, hf_vocab_size: int) -> None:
    """Copy the HF checkpoint's tensors into this rank's shards of ``model`` (the unwrapped ``GPTModel``).

    Every parameter must be found (an error lists the missing HF names), except that a critic may lack its value
    head (``score``: ``hf_dir`` is a policy) or its unused LM head (``hf_dir`` is a critic); HF tensors no rank of
    this stage uses are ignored (e.g. GLM-4.5's MTP layers). A tied ``output_layer`` (last pipeline stage) reads the embedding.
    """
    reader = _SafetensorsDir(hf_dir)
    shape = attention_shape(model)
    critic_optional = ("value_head.", "output_layer.") if hasattr(model, "value_head") else ()
    missing = []
    for entry in local_tensors(model):
        names = entry.hf_names
        if entry.canonical == "output_layer.weight" and names[0] not in reader:
            names = ["model.embed_tokens.weight"]  # tied embeddings
        absent = [n for n in names if n not in reader]
        if absent and entry.canonical.startswith(critic_optional):
            continue  # a critic: a policy has no value head (the new one keeps its init), a critic no LM head
        if absent:
            missing += absent
            continue
        full = hf_mapping.to_mcore(entry.kind, [reader.get(n) for n in names], shape)
        if entry.canonical in hf_mapping.VOCAB_PARAMS:
            rank, size = entry.tp_rank_size()
            full = hf_mapping.pad_vocab(full[:hf_vocab_size], entry.tensor.shape[0] * size)
        if entry.tp_dim is not None:
            rank, size = entry.tp_rank_size()
            full = hf_mapping.shard(entry.kind, full, entry.tp_dim, rank, size)
        if tuple(full.shape) != tuple(entry.tensor.shape):
            raise ValueError(
                f"{hf_dir}: {names} give shape {tuple(full.shape)} for {entry.local_name} "
                f"(expected {tuple(entry.tensor.shape)}); do the Megatron flags match config.json?"
            )
        with torch.no_grad():
            entry.tensor.copy_(full)
    if missing:
        raise KeyError(f"{hf_dir} lacks tensors the Megatron model needs: {missing[:8]}")


# --------------------------------------------------------------------------------------------------- export
def _gather_tp(entry: LocalTensor) -> torch.Tensor:
    rank, size = entry.tp_rank_size()
    local = entry.tensor.detach()
    if size == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.contiguous(), group=entry.tp_group())
    return hf_mapping.unshard(entry.kind, shards, entry.tp_dim)


def _sort_key(canonical: str) -> tuple:
    match = _LAYER.match(canonical)
    expert = _EXPERT.search(canonical)
    if canonical.startswith("embedding."):
        return (0, 0, 0, canonical)
    if match:
        return (1, int(match.group(1)), int(expert.group(1)) if expert else -1, canonical)
    return (2, 0, 0, canonical)


def iter_hf_tensors(
    model, hf_vocab_size: int, dtype: torch.dtype, stack_experts: bool = False
) -> Iterator[tuple[str, torch.Tensor | StackedTensor]]:
    """Every HF tensor of the model, full, on every rank, in layer order (collective: all ranks iterate to the
    end in step). Tied output layers are left out (HF ties ``lm_head`` to the embedding). With ``stack_experts``
    each MoE layer's routed experts come as two stacked tensors (``hf_mapping.stack_experts``), never copied into
    one before they are flattened."""
    tied = (
        model.share_embeddings_and_output_weights
        if hasattr(model, "share_embeddings_and_output_weights")
        else False
    )
    entries = {
        e.canonical: e for e in local_tensors(model) if not (tied and e.canonical == "output_layer.weight")
    }
    shape = attention_shape(model)
    mla = model.config.multi_latent_attention
    single_holder = (
        parallel_state.get_pipeline_model_parallel_world_size() == 1
        and parallel_state.get_expert_model_parallel_world_size() == 1
    )
    if single_holder:
        order = [(name, None, None) for name in sorted(entries, key=_sort_key)]
    else:
        # What each rank holds (name, full shape, dtype); each tensor is broadcast from its lowest holder.
        mine = []
        for name, e in entries.items():
            full_shape = list(e.tensor.shape)
            if e.tp_dim is not None:
                full_shape[e.tp_dim] *= e.tp_rank_size()[1]
            mine.append((name, full_shape, str(e.tensor.dtype).removeprefix("torch.")))
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        owner: dict[str, tuple[int, list[int], str]] = {}
        for rank, held in enumerate(everyone):
            for name, full_shape, dt in held:
                owner.setdefault(name, (rank, full_shape, dt))
        order = [(name, *owner[name]) for name in sorted(owner, key=_sort_key)]
    device = torch.device("cuda", torch.cuda.current_device())

    def canonical_full() -> Iterator[tuple[str, torch.Tensor]]:
        for item in order:
            name = item[0]
            entry = entries.get(name)
            full = _gather_tp(entry) if entry is not None else None
            if not single_holder:
                src, full_shape, dt = item[1], item[2], item[3]
                if full is None:
                    full = torch.empty(full_shape, dtype=getattr(torch, dt), device=device)
                full = full.contiguous()
                dist.broadcast(full, src=src)
            if name in hf_mapping.VOCAB_PARAMS:
                full = full[:hf_vocab_size]
            yield name, (full.to(dtype) if full.is_floating_point() else full)

    named = hf_mapping.stack_experts(canonical_full()) if stack_experts else canonical_full()
    for name, full in named:
        if isinstance(full, StackedTensor):
            yield name, full
            continue
        entry = entries.get(name)
        names, kind = (entry.hf_names, entry.kind) if entry is not None else hf_mapping.hf_names(name, mla)
        yield from zip(names, hf_mapping.to_hf(kind, full, shape), strict=True)


def iter_weight_buckets(
    model, hf_vocab_size: int, buffer_bytes: int, dtype: torch.dtype, stack_experts: bool = False
) -> Iterator[Bucket]:
    """:func:`iter_hf_tensors` grouped into lists of at most ``buffer_bytes`` (a larger tensor is alone)."""
    return in_buckets(iter_hf_tensors(model, hf_vocab_size, dtype, stack_experts), buffer_bytes)
