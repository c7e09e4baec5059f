"""GroupedGemmExperts (stacked expert weights) against Megatron-Core's SequentialMLP built from the same seed, on
the CPU in one gloo process (needs megatron-core): the same weights under the same per-expert names, the same
forward and gradients (the per-expert fallback path, fp32), and torch_dist checkpoints that load either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer.mlp import MLPSubmodules  # noqa: E402
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from vime.backends.megatron_utils.grouped_experts import (  # noqa: E402
    GroupedGemmExperts,
    check_expert_patterns,
    per_expert,
    per_expert_parameters,
)

TOKENS = [3, 0, 5, 4]  # expert 1 gets no tokens
PREFIX = "decoder.layers.0.mlp.experts."


@pytest.fixture(scope="module", autouse=True)
def one_process_group(tmp_path_factory):
    created = not dist.is_initialized()
    if created:
        store = tmp_path_factory.mktemp("dist") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():  # a trainer of an earlier test in this process
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


class FakeGroup:
    """A process group as the experts' sharded_state_dict asks it: this rank and the size only."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def build(cls, gated: bool, seed: int, placed: bool = False):
    """``cls`` experts; ``placed``: as on rank 1 of 2 expert-parallel ranks, 1 of 2 expert-tensor-parallel ranks and
    3 of 4 expert-data-parallel ranks (for the checkpoint offsets and replica ids only: nothing is communicated)."""
    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=len(TOKENS), moe_router_topk=2,
        ffn_hidden_size=8, moe_ffn_hidden_size=8, gated_linear_unit=gated, activation_func=F.silu,
        bias_activation_fusion=False, add_bias_linear=False, use_cpu_initialization=True,
    )  # fmt: skip
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    if placed:
        groups.ep, groups.expt_tp, groups.expt_dp = FakeGroup(1, 2), FakeGroup(1, 2), FakeGroup(3, 4)
    torch.manual_seed(seed)
    return cls(len(TOKENS), config, submodules, pg_collection=groups)


def named(model: torch.nn.Module, prefix: str = PREFIX) -> dict[str, torch.Tensor]:
    return {prefix + n: t for n, t in per_expert_parameters(model)}


@pytest.mark.parametrize("gated", [True, False])
def test_stacked_experts_are_sequential_mlps_weights_under_its_names(gated):
    sequential, stacked = build(SequentialMLP, gated, 0), build(GroupedGemmExperts, gated, 0)
    assert [n for n, _ in stacked.named_parameters()] == ["stacked_fc1_weight", "stacked_fc2_weight"]
    want = {PREFIX + n: p for n, p in sequential.named_parameters()}
    got = named(stacked)
    assert sorted(got) == sorted(want)  # per projection, then per expert; SequentialMLP the other way round
    for name, param in want.items():
        assert torch.equal(got[name], param), name
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce"):
            assert getattr(got[name], attr) == getattr(param, attr), (name, attr)
    fc1 = stacked.stacked_fc1_weight
    assert fc1.shape == (len(TOKENS), 16 if gated else 8, 16) and fc1.partition_dim == 1
    assert stacked.stacked_fc2_weight.partition_dim == 2
    # the views write through: what loading HF weights into the per-expert names relies on
    with torch.no_grad():
        got[PREFIX + "local_experts.2.linear_fc2.weight"].fill_(3.0)
    assert torch.all(stacked.stacked_fc2_weight[2] == 3.0)


def test_a_pattern_naming_single_stacked_experts_is_refused_with_the_way_out():
    stacked, sequential = build(GroupedGemmExperts, True, 0), build(SequentialMLP, True, 0)
    single = {"--freeze-params-name-list": [r"local_experts\.1\."], "--only-train-params-name-list": None}
    with pytest.raises(
        ValueError, match="--freeze-params-name-list .* names single experts.*stacked_fc1_weight"
    ):
        check_expert_patterns(stacked, single)
    check_expert_patterns(sequential, single)  # per-expert parameters: the pattern is fine
    whole = {"--only-train-params-name-list": ["stacked_fc1_weight"]}
    check_expert_patterns(stacked, whole)  # all of a layer's experts: fine
    check_expert_patterns(stacked, {"--freeze-params-name-list": ["no_such_weight"]})  # freeze.py's error


def test_a_distributed_optimizers_state_does_not_load_across_expert_layouts(tmp_path):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from vime.backends.megatron_utils.checkpoint import check_optimizer_layout, expert_layout

    stacked, sequential = build(GroupedGemmExperts, True, 0), build(SequentialMLP, True, 0)
    assert (expert_layout(stacked), expert_layout(sequential)) == ("stacked", "per-expert")
    distributed = object.__new__(DistributedOptimizer)  # only its type is asked
    with pytest.raises(
        ValueError, match="saved with per-expert expert weights.*Resume without --moe-grouped-gemm"
    ):
        check_optimizer_layout({}, stacked, distributed, tmp_path)  # a checkpoint from before stacked experts
    with pytest.raises(ValueError, match="saved with stacked expert weights.*Resume with --moe-grouped-gemm"):
        check_optimizer_layout({"expert_layout": "stacked"}, sequential, distributed, tmp_path)
    check_optimizer_layout({"expert_layout": "stacked"}, stacked, distributed, tmp_path)  # same layout
    plain = torch.optim.SGD(sequential.parameters(), lr=0.1)  # keyed per parameter: loads either way
    check_optimizer_layout({"expert_layout": "stacked"}, sequential, plain, tmp_path)


@pytest.mark.parametrize("gated", [True, False])
def test_fallback_forward_and_backward_match_sequential_mlp(gated):
    sequential, stacked = build(SequentialMLP, gated, 1), build(GroupedGemmExperts, gated, 1)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(sum(TOKENS), 16, generator=gen)
    probs = torch.rand(sum(TOKENS), generator=gen)
    grad_out = torch.randn(sum(TOKENS), 16, generator=gen)
    results = []
    for model in (sequential, stacked):
        x = hidden.clone().requires_grad_()
        out, bias = model(x, torch.tensor(TOKENS), probs)
        out.backward(grad_out)
        grads = {n: g for name, p in model.named_parameters() for n, g in per_expert(name, p.grad)}
        results.append((out.detach(), bias, x.grad, grads))
    (out_a, bias_a, gx_a, grads_a), (out_b, bias_b, gx_b, grads_b) = results
    assert bias_a is None and bias_b is None
    torch.testing.assert_close(out_b, out_a)
    torch.testing.assert_close(gx_b, gx_a)
    assert sorted(grads_b) == sorted(grads_a)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad)
    assert torch.count_nonzero(grads_b["local_experts.1.linear_fc1.weight"]) == 0


def _checkpoint_entries(model) -> dict[str, tuple]:
    """torch_dist key -> (global shape, offsets of this rank's pieces, replica id) of ``model``'s sharded state dict,
    expert by expert for the stacked ones."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    entries = {}
    for entry in model.sharded_state_dict(prefix=PREFIX).values():
        pieces = entry.build() if isinstance(entry, ShardedTensorFactory) else [entry]
        for piece in pieces:
            if isinstance(piece, ShardedObject):
                entries.setdefault(piece.key, set()).add(
                    ("object", piece.global_shape, piece.global_offset, piece.replica_id)
                )
                continue
            for e in range(piece.local_shape[0] if piece.prepend_axis_num == 0 else 1):
                offset = list(piece.global_offset)
                offset[0] += e
                entries.setdefault(piece.key, set()).add(
                    (piece.global_shape, tuple(offset), piece.replica_id)
                )
    return entries


@pytest.mark.parametrize("placed", [False, True])
@pytest.mark.parametrize("gated", [True, False])
def test_sharded_state_dict_has_sequential_mlps_keys(gated, placed):
    sequential, stacked = build(SequentialMLP, gated, 0, placed), build(GroupedGemmExperts, gated, 0, placed)
    want, got = _checkpoint_entries(sequential), _checkpoint_entries(stacked)
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key] == want[key], key


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize(
    "save_cls,load_cls", [(SequentialMLP, GroupedGemmExperts), (GroupedGemmExperts, SequentialMLP)]
)
def test_torch_dist_checkpoint_loads_into_the_other_layout(gated, save_cls, load_cls, tmp_path, monkeypatch):
    if not torch.cuda.is_available():  # the torch_dist writer syncs CUDA and broadcasts its status from there
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    saved, loaded = build(save_cls, gated, 3), build(load_cls, gated, 4)
    assert not torch.equal(
        named(saved)[PREFIX + "local_experts.3.linear_fc1.weight"],
        named(loaded)[PREFIX + "local_experts.3.linear_fc1.weight"],
    )
    dist_checkpointing.save(saved.sharded_state_dict(prefix=PREFIX), str(tmp_path))
    state = dist_checkpointing.load(loaded.sharded_state_dict(prefix=PREFIX), str(tmp_path))
    result = loaded.load_state_dict({k.removeprefix(PREFIX): v for k, v in state.items()}, strict=False)
    assert not [k for k in result.missing_keys if not k.endswith("_extra_state")]
    want, got = named(saved), named(loaded)
    assert sorted(got) == sorted(want)  # per projection, then per expert; SequentialMLP the other way round
    for name in want:
        assert torch.equal(got[name], want[name]), name


def as_gpt_model(experts: torch.nn.Module) -> torch.nn.Module:
    """``experts`` as layer 0's experts of a GPTModel-shaped module (what ``weights`` reads of one)."""
    model = torch.nn.Module()
    model.config = experts.config
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.decoder.layers[0].layer_number = 1
    model.decoder.layers[0].mlp = torch.nn.Module()
    model.decoder.layers[0].mlp.experts = experts
    return model


@pytest.mark.parametrize("gated", [True, False])
def test_hf_weights_load_into_stacked_experts_under_sequential_mlps_mapping(gated, tmp_path):
    from safetensors.torch import save_file

    from vime.backends.megatron_utils import hf_mapping, weights

    sequential = as_gpt_model(build(SequentialMLP, gated, 5))
    stacked = as_gpt_model(build(GroupedGemmExperts, gated, 6))
    want = {e.canonical: e for e in weights.local_tensors(sequential)}
    got = {e.canonical: e for e in weights.local_tensors(stacked)}
    assert sorted(got) == sorted(want)
    for name, entry in want.items():
        assert (got[name].hf_names, got[name].kind, got[name].tp_dim, got[name].is_expert) == (
            entry.hf_names,
            entry.kind,
            entry.tp_dim,
            entry.is_expert,
        ), name
    shape = weights.attention_shape(sequential)
    hf = {}
    for entry in want.values():
        hf.update(
            zip(entry.hf_names, hf_mapping.to_hf(entry.kind, entry.tensor.detach(), shape), strict=True)
        )
    save_file({n: t.contiguous() for n, t in hf.items()}, tmp_path / "model.safetensors")
    weights.load_hf_weights(stacked, tmp_path, hf_vocab_size=0)
    for name, entry in want.items():
        assert torch.equal(got[name].tensor, entry.tensor), name
