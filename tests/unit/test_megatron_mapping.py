"""HF <-> Megatron names, qkv/fc1 layouts, TP shards, config checks and per-role YAML (no Megatron import)."""

from __future__ import annotations

import argparse

import pytest
import torch

from vime.backends.megatron_utils import hf_mapping
from vime.backends.megatron_utils.config import role_overrides
from vime.backends.megatron_utils.hf_config import check_hf_config, flags_from_hf_config, flags_to_argv
from vime.backends.megatron_utils.hf_mapping import AttentionShape


def test_names_round_trip_for_dense_moe_and_shared_experts():
    for name in [
        "embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight",
        "decoder.layers.3.self_attention.linear_qkv.weight", "decoder.layers.3.self_attention.q_layernorm.weight",
        "decoder.layers.3.mlp.linear_fc1.weight", "decoder.layers.0.mlp.router.weight",
        "decoder.layers.1.mlp.experts.local_experts.17.linear_fc1.weight",
        "decoder.layers.1.mlp.experts.local_experts.17.linear_fc2.weight",
        "decoder.layers.2.mlp.shared_experts.linear_fc1.weight",
    ]:  # fmt: skip
        hf, _ = hf_mapping.hf_names(name)
        assert all(hf_mapping.mcore_name(h) == name for h in hf), (name, hf)
    assert hf_mapping.hf_names("decoder.layers.1.mlp.experts.local_experts.17.linear_fc1.weight") == (
        ["model.layers.1.mlp.experts.17.gate_proj.weight", "model.layers.1.mlp.experts.17.up_proj.weight"],
        "fc1",
    )
    with pytest.raises(KeyError, match="no HF name"):
        hf_mapping.hf_names("decoder.layers.0.unknown.weight")


@pytest.mark.parametrize("heads,groups", [(4, 4), (8, 2), (4, 1)])
def test_qkv_layout_groups_queries_with_their_kv_head(heads, groups):
    shape, d, hidden = AttentionShape(heads, groups, 3), 3, 5
    q, k, v = torch.randn(heads * d, hidden), torch.randn(groups * d, hidden), torch.randn(groups * d, hidden)
    fused = hf_mapping.fuse_qkv(q, k, v, shape)
    per = heads // groups
    block = fused.view(groups, (per + 2) * d, hidden)
    for g in range(groups):
        assert torch.equal(block[g, : per * d], q[g * per * d : (g + 1) * per * d])
        assert torch.equal(block[g, per * d : (per + 1) * d], k[g * d : (g + 1) * d])
        assert torch.equal(block[g, (per + 1) * d :], v[g * d : (g + 1) * d])
    assert all(torch.equal(a, b) for a, b in zip(hf_mapping.split_qkv(fused, shape), (q, k, v), strict=True))
    bias = hf_mapping.fuse_qkv(q[:, 0], k[:, 0], v[:, 0], shape)
    assert torch.equal(bias, fused[:, 0])


def test_tp_shards_of_fc1_hold_their_gate_and_up_rows():
    gate, up = torch.arange(8.0).view(4, 2), 100 + torch.arange(8.0).view(4, 2)
    full = hf_mapping.fuse_fc1(gate, up)
    shards = [hf_mapping.shard("fc1", full, 0, r, 2) for r in range(2)]
    assert torch.equal(shards[0], torch.cat([gate[:2], up[:2]]))
    assert torch.equal(hf_mapping.unshard("fc1", shards, 0), full)
    row = torch.randn(6, 4)
    parts = [hf_mapping.shard("plain", row, 1, r, 2) for r in range(2)]
    assert torch.equal(hf_mapping.unshard("plain", parts, 1), row)


def test_vocab_padding():
    assert hf_mapping.padded_vocab_size(61, 128, 2) == 256
    padded = hf_mapping.pad_vocab(torch.ones(61, 3), 128)
    assert padded.shape == (128, 3) and padded[61:].abs().sum() == 0


QWEN3_4B = {
    "model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 2560, "intermediate_size": 9728,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
    "rope_theta": 1000000, "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
    "tie_word_embeddings": True, "vocab_size": 151936,
}  # fmt: skip


def _args(argv):
    from vime.utils.megatron_args import add_megatron_arguments

    parser = argparse.ArgumentParser()
    add_megatron_arguments(parser)
    return parser.parse_args(argv)


def test_flags_from_config_pass_the_check_and_a_wrong_flag_is_named():
    flags = flags_from_hf_config(QWEN3_4B)
    assert (
        flags["num_query_groups"] == 8
        and flags["qk_layernorm"]
        and not flags["untie_embeddings_and_output_weights"]
    )
    check_hf_config(_args(flags_to_argv(flags)), QWEN3_4B)
    with pytest.raises(ValueError, match=r"--num-layers=12 but config.json implies 36"):
        check_hf_config(_args(flags_to_argv(flags) + ["--num-layers", "12"]), QWEN3_4B)


def test_moe_router_flags():
    moe = {**QWEN3_4B, "model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8,
           "moe_intermediate_size": 768, "norm_topk_prob": True}  # fmt: skip
    flags = flags_from_hf_config(moe)
    assert (
        flags["num_experts"] == 128 and flags["moe_router_topk"] == 8 and not flags["moe_router_pre_softmax"]
    )
    assert flags_from_hf_config({**moe, "norm_topk_prob": False})["moe_router_pre_softmax"]


def test_role_overrides():
    data = {"lr": 1e-6, "recompute-granularity": "full", "critic": {"lr": 1e-5}}
    assert role_overrides(data, "actor") == {"lr": 1e-6, "recompute_granularity": "full"}
    assert role_overrides(data, "critic")["lr"] == 1e-5


def _model_args(script: str) -> list[str]:
    import subprocess
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "models" / script
    out = subprocess.run(
        ["bash", "-c", f'source "{path}"; printf "%s\\0" "${{MODEL_ARGS[@]}}"'],
        capture_output=True,
        check=True,
    )
    return out.stdout.decode().split("\0")[:-1]


@pytest.mark.parametrize(
    "script", ["qwen3-0.6B.sh", "qwen3-4B.sh", "qwen3-30B-A3B.sh", "llama3-8B.sh", "glm4.5-air.sh"]
)
def test_model_scripts_parse(script):
    args = _args(_model_args(script))
    assert args.num_layers and args.hidden_size and args.transformer_impl == "local"


def test_qwen3_4b_script_matches_its_config():
    check_hf_config(_args(_model_args("qwen3-4B.sh")), QWEN3_4B)
