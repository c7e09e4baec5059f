"""Stacked MoE experts (one tensor per layer and projection): the bucket format, the HF per-expert expansion, the
Megatron sender's stacking, and the engine-side write into a real vLLM fused-MoE layer (``RoutedExperts``, built on
CPU with TP/EP ranks set by hand), which must equal vLLM's own per-expert loading.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from vime.backends.megatron_utils import hf_mapping
from vime.backends.vllm_utils.stacked_expert_loader import load_weights, write_stacked
from vime.utils.stacked_experts import expand_stacked, parse_stacked, stacked_name
from vime.utils.weight_buckets import StackedTensor, flatten_bucket, in_buckets, unflatten_bucket

E, H, INTER = 8, 64, 32  # experts, hidden, MoE intermediate (full)
PREFIX = "model.layers.0.mlp.experts"


def stacked_pair(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random stacked ``w13`` [E, 2I, H] and ``w2`` [E, H, I]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * INTER, H, generator=gen), torch.randn(E, H, INTER, generator=gen)


def per_expert(w13: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
    """The HF per-expert tensors of a stacked pair, built independently of ``expand_stacked``."""
    out = {}
    for e in range(E):
        out[f"{PREFIX}.{e}.gate_proj.weight"] = w13[e, :INTER]
        out[f"{PREFIX}.{e}.up_proj.weight"] = w13[e, INTER:]
        out[f"{PREFIX}.{e}.down_proj.weight"] = w2[e]
    return out


# ------------------------------------------------------------------------------------------- bucket format
def test_stacked_names_round_trip():
    assert parse_stacked(stacked_name(PREFIX, "w13")) == (PREFIX, "w13")
    assert parse_stacked(stacked_name(PREFIX, "w2")) == (PREFIX, "w2")
    assert parse_stacked(f"{PREFIX}.0.gate_proj.weight") is None
    with pytest.raises(ValueError, match="w13"):
        stacked_name(PREFIX, "gate")


def test_stacked_tensor_is_flattened_part_by_part_and_read_back_whole():
    parts = [torch.randn(2 * INTER, H) for _ in range(E)]
    stacked = StackedTensor(parts)
    bucket = [("model.norm.weight", torch.randn(H)), (stacked_name(PREFIX, "w13"), stacked)]
    assert [len(b) for b in in_buckets(bucket, stacked.numel() * 4 + H * 4)] == [2]
    buffer, layout = flatten_bucket(bucket, torch.device("cpu"))
    assert layout[1]["shape"] == [E, 2 * INTER, H] and layout[1]["dtype"] == "float32"
    restored = dict(unflatten_bucket(buffer, layout))
    assert torch.equal(restored[stacked_name(PREFIX, "w13")], torch.stack(parts))
    assert torch.equal(restored["model.norm.weight"], bucket[0][1])


def test_stacked_tensor_refuses_unequal_parts():
    with pytest.raises(ValueError, match="differ"):
        StackedTensor([torch.zeros(2, 3), torch.zeros(3, 3)])


def test_expansion_gives_hf_names_and_values_as_views():
    w13, w2 = stacked_pair()
    named = [
        ("model.norm.weight", torch.ones(H)),
        (stacked_name(PREFIX, "w13"), w13),
        (stacked_name(PREFIX, "w2"), w2),
    ]
    expanded = list(expand_stacked(named))
    got = dict(expanded)
    assert len(got) == len(expanded) == 1 + 3 * E
    want = per_expert(w13, w2)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    for name, tensor in expanded[1:]:  # views into the stacked tensors, no copy
        base = w13 if "gate" in name or "up" in name else w2
        assert base.data_ptr() <= tensor.data_ptr() < base.data_ptr() + base.numel() * 4, name
    assert torch.equal(got["model.norm.weight"], torch.ones(H))


# ------------------------------------------------------------------------------------- Megatron sender side
def canonical_layer(layer: int, gen: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    """Full canonical Megatron tensors of one MoE layer, in the sender's order (experts last, by index)."""
    pairs = [(f"decoder.layers.{layer}.mlp.router.weight", torch.randn(E, H, generator=gen))]
    for e in range(E):
        base = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}"
        pairs.append((f"{base}.linear_fc1.weight", torch.randn(2 * INTER, H, generator=gen)))
        pairs.append((f"{base}.linear_fc2.weight", torch.randn(H, INTER, generator=gen)))
    return pairs


def hf_of(pairs) -> dict[str, torch.Tensor]:
    """Per-expert HF tensors of canonical pairs the way the unstacked export maps them."""
    out = {}
    for name, tensor in pairs:
        names, kind = hf_mapping.hf_names(name)
        out.update(zip(names, hf_mapping.to_hf(kind, tensor, None), strict=True))
    return out


def test_megatron_stacking_expands_to_the_unstacked_export():
    gen = torch.Generator().manual_seed(1)
    pairs = [("embedding.word_embeddings.weight", torch.randn(10, H, generator=gen))]
    pairs += canonical_layer(0, gen) + canonical_layer(1, gen)
    pairs.append(("decoder.final_layernorm.weight", torch.randn(H, generator=gen)))
    stacked = list(hf_mapping.stack_experts(iter(pairs)))
    names = [n for n, _ in stacked]
    assert names == [
        "embedding.word_embeddings.weight",
        "decoder.layers.0.mlp.router.weight",
        "model.layers.0.mlp.experts.vime_stacked_w13",
        "model.layers.0.mlp.experts.vime_stacked_w2",
        "decoder.layers.1.mlp.router.weight",
        "model.layers.1.mlp.experts.vime_stacked_w13",
        "model.layers.1.mlp.experts.vime_stacked_w2",
        "decoder.final_layernorm.weight",
    ]
    assert all(isinstance(t, StackedTensor) for n, t in stacked if parse_stacked(n))
    buffer, layout = flatten_bucket(stacked, torch.device("cpu"))
    received = [(n, t) for n, t in unflatten_bucket(buffer, layout) if parse_stacked(n)]
    got = dict(expand_stacked(received))
    want = {n: t for n, t in hf_of(pairs).items() if ".experts." in n}
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_megatron_stacking_refuses_missing_experts():
    pairs = [
        p
        for p in canonical_layer(0, torch.Generator().manual_seed(2))
        if "local_experts.3.linear_fc2" not in p[0]
    ]
    with pytest.raises(ValueError, match="layer 0"):
        list(hf_mapping.stack_experts(iter(pairs)))


# ------------------------------------------------------------------------------------ vLLM engine side
def routed_experts(
    tp_size: int, tp_rank: int, ep_size: int, ep_rank: int, placement: str = "linear"
) -> nn.Module:
    """A real vLLM fused-MoE expert container (unquantized, fp32, on CPU) as TP rank ``tp_rank`` of ``tp_size`` and
    EP rank ``ep_rank`` of ``ep_size``, its parameters zeroed."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    saved = dict(os.environ)  # VllmConfig() sets vLLM's variables (its platform's config hook): put them back
    config = VllmConfig()
    os.environ.clear()
    os.environ.update(saved)
    with set_current_vllm_config(config):
        parallel = FusedMoEParallelConfig(
            tp_size=tp_size, pcp_size=1, dp_size=1, ep_size=ep_size, tp_rank=tp_rank, pcp_rank=0, dp_rank=0,
            ep_rank=ep_rank, sp_size=1, use_ep=ep_size > 1, all2all_backend="naive", enable_eplb=False,
        )  # fmt: skip
        experts = ExpertMapManager(
            max_num_batched_tokens=64, top_k=2, global_num_experts=E, num_redundant_experts=0, num_expert_group=None,
            moe_parallel_config=parallel, placement_strategy=placement, enable_eplb=False,
        )  # fmt: skip
        config = FusedMoEConfig(
            num_experts=E, experts_per_token=2, hidden_dim=H, intermediate_size=INTER,
            num_local_experts=experts.local_num_experts, num_logical_experts=E, activation=MoEActivation.SILU,
            device="cpu", routing_method=RoutingMethodType.Renormalize, moe_parallel_config=parallel,
            in_dtype=torch.float32,
        )  # fmt: skip
        layer = RoutedExperts(PREFIX, torch.float32, config, None, experts)
    with torch.no_grad():
        layer.w13_weight.zero_()
        layer.w2_weight.zero_()
    return layer


# (tp_size, ep_size, placement): engine TP splits the intermediate dim, EP the experts
PARALLEL = [(1, 1, "linear"), (2, 1, "linear"), (1, 2, "linear"), (2, 2, "linear"), (1, 4, "round_robin"), (2, 2, "round_robin")]  # fmt: skip


@pytest.mark.parametrize(("tp_size", "ep_size", "placement"), PARALLEL)
def test_stacked_write_equals_vllm_per_expert_loading(tp_size, ep_size, placement):
    w13, w2 = stacked_pair(seed=tp_size * 10 + ep_size)
    hf = per_expert(w13, w2)
    for tp_rank in range(tp_size):
        for ep_rank in range(ep_size):
            reference = routed_experts(tp_size, tp_rank, ep_size, ep_rank, placement)
            # vLLM's own per-expert path: RoutedExperts.load_weights -> weight_loader once per expert and shard
            list(reference.load_weights([(n.removeprefix(PREFIX + "."), t) for n, t in hf.items()]))
            stacked = routed_experts(tp_size, tp_rank, ep_size, ep_rank, placement)
            write_stacked(stacked, "w13", w13)
            write_stacked(stacked, "w2", w2)
            assert stacked.w13_weight.shape[1] == 2 * INTER // tp_size
            assert (
                torch.count_nonzero(reference.w13_weight) == reference.w13_weight.numel()
            )  # every slot loaded
            assert torch.equal(stacked.w13_weight, reference.w13_weight), (tp_rank, ep_rank)
            assert torch.equal(stacked.w2_weight, reference.w2_weight), (tp_rank, ep_rank)


class FakeModel(nn.Module):
    """A vLLM model stand-in: ``model.layers.0.mlp.experts`` is ``experts``, ``load_weights`` records its input."""

    def __init__(self, experts: nn.Module | None):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module()])
        self.model.layers[0].mlp = nn.Module()
        if experts is not None:
            self.model.layers[0].mlp.experts = experts
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights):
        self.loaded.extend(weights)


class Runner(nn.Module):
    """vLLM's MoE runner keeps the expert parameters in ``routed_experts``."""

    def __init__(self, routed: nn.Module):
        super().__init__()
        self.routed_experts = routed


def test_bucket_load_writes_stacked_experts_and_passes_the_rest_to_load_weights():
    w13, w2 = stacked_pair(seed=3)
    model = FakeModel(Runner(routed_experts(2, 1, 2, 0)))
    norm = ("model.norm.weight", torch.ones(H))
    counts = load_weights(model, [norm, (stacked_name(PREFIX, "w13"), w13), (stacked_name(PREFIX, "w2"), w2)])
    assert counts == (2, 0)
    assert [n for n, _ in model.loaded] == ["model.norm.weight"]
    reference = routed_experts(2, 1, 2, 0)
    list(reference.load_weights([(n.removeprefix(PREFIX + "."), t) for n, t in per_expert(w13, w2).items()]))
    assert torch.equal(model.model.layers[0].mlp.experts.routed_experts.w13_weight, reference.w13_weight)


def test_bucket_load_falls_back_to_per_expert_names_without_a_fused_layer():
    w13, w2 = stacked_pair(seed=4)
    model = FakeModel(None)
    assert load_weights(model, [(stacked_name(PREFIX, "w13"), w13), (stacked_name(PREFIX, "w2"), w2)]) == (
        0,
        2,
    )
    got = dict(model.loaded)
    want = per_expert(w13, w2)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], t) for n, t in want.items())


def test_quantized_layer_is_refused_naming_it():
    layer = routed_experts(1, 0, 1, 0)
    layer.quant_method = nn.Identity()  # any method but the unquantized one
    w13, _ = stacked_pair()
    with pytest.raises(ValueError, match=rf"{PREFIX}: quantized \(Identity\)"):
        load_weights(FakeModel(layer), [(stacked_name(PREFIX, "w13"), w13)])


def test_expert_count_mismatch_is_refused():
    with pytest.raises(ValueError, match="4 experts, the engine has 8"):
        write_stacked(routed_experts(1, 0, 1, 0), "w2", torch.zeros(4, H, INTER))
