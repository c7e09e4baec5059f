"""HF <-> Megatron names, qkv/fc1 layouts, TP shards, config checks and per-role YAML (no Megatron import)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch

from vime.backends.megatron_utils import hf_mapping
from vime.backends.megatron_utils.config import role_args, role_overrides
from vime.backends.megatron_utils.hf_config import (
    check_hf_config,
    flags_from_hf_config,
    flags_to_argv,
    load_hf_config,
)
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


def test_role_args_are_a_new_namespace_and_the_parsed_flags_stay(tmp_path):
    config = tmp_path / "megatron.yaml"
    config.write_text("lr: 1.0e-6\ncritic:\n  lr: 1.0e-5\n")
    args = argparse.Namespace(megatron_config_path=str(config), lr=3e-4, seed=1)
    critic, actor = role_args(args, "critic"), role_args(args, "actor")
    assert (critic.lr, actor.lr, args.lr) == (1e-5, 1e-6, 3e-4) and critic.seed == 1
    assert role_args(argparse.Namespace(megatron_config_path=None), "actor").megatron_config_path is None
    config.write_text("lrr: 1.0\n")
    with pytest.raises(ValueError, match="unknown flag 'lrr'"):
        role_args(args, "actor")


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


LLAMA3_8B = {
    "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192, "rope_theta": 500000.0,
    "rope_scaling": None, "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False,
    "mlp_bias": False, "tie_word_embeddings": False, "vocab_size": 128256,
}  # fmt: skip
GLM45_AIR = {
    "model_type": "glm4_moe", "num_hidden_layers": 46, "hidden_size": 4096, "intermediate_size": 10944,
    "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5,
    "max_position_embeddings": 131072, "rope_theta": 1000000, "rope_scaling": None, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "attention_bias": True, "use_qk_norm": False, "tie_word_embeddings": False,
    "vocab_size": 151552, "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "moe_intermediate_size": 1408, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 1,
}  # fmt: skip


@pytest.mark.parametrize("script,config", [("llama3-8B.sh", LLAMA3_8B), ("glm4.5-air.sh", GLM45_AIR)])
def test_llama3_and_glm45_scripts_match_their_configs(script, config):
    check_hf_config(_args(_model_args(script)), config)


def test_llama3_rope_scaling_and_glm45_routing_megatron_cannot_reproduce_are_refused():
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    assert flags_from_hf_config({**LLAMA3_8B, "rope_scaling": llama31})["rope_scaling_factor"] == 8.0
    with pytest.raises(ValueError, match="Megatron-Core fixes"):  # it hard-codes all but the factor
        flags_from_hf_config({**LLAMA3_8B, "rope_scaling": {**llama31, "high_freq_factor": 2.0}})
    with pytest.raises(ValueError, match="'yarn'"):  # not silently plain RoPE
        flags_from_hf_config({**LLAMA3_8B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="norm_topk_prob=false"):  # Megatron always renormalises the top k
        flags_from_hf_config({**GLM45_AIR, "norm_topk_prob": False})


@pytest.fixture(scope="module")
def gpu_test_module():
    """tests/gpu/test_megatron_gpu.py: its model builders and make_args need transformers only, not CUDA."""
    path = Path(__file__).resolve().parents[1] / "gpu" / "test_megatron_gpu.py"
    spec = importlib.util.spec_from_file_location("_megatron_gpu_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_hf(gpu_test_module, tmp_path_factory):
    """The tiny random-init HF Llama 3 and GLM-4.5 checkpoints the GPU tests run."""
    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": gpu_test_module.build_llama(root / "llama"),
        "glm4_moe": gpu_test_module.build_glm4_moe(root / "glm4_moe"),
    }


@pytest.mark.parametrize("kind", ["llama", "glm4_moe"])
def test_tiny_llama_and_glm45_flags_parse_and_pass_the_check(gpu_test_module, tiny_hf, kind, monkeypatch):
    from vime.utils import arg_validation

    # parse_args refuses --train-backend megatron without megatron-core and CUDA; everything else is checked
    monkeypatch.setattr(arg_validation, "_check_backend", lambda args: None)
    args = gpu_test_module.make_args(tiny_hf[kind])
    assert args.train_backend == "megatron"
    check_hf_config(args, load_hf_config(tiny_hf[kind]))  # the trainer's start-up check


def test_tiny_llama_and_glm45_flags(tiny_hf):
    llama = flags_from_hf_config(load_hf_config(tiny_hf["llama"]))
    assert llama["rotary_base"] == 500000 and llama["rotary_percent"] == 1.0
    assert llama["use_rope_scaling"] and llama["rope_scaling_factor"] == 8.0
    assert llama["num_query_groups"] == 2 and llama["group_query_attention"] and llama["kv_channels"] == 64
    assert not (llama["add_qkv_bias"] or llama["qk_layernorm"] or llama["add_bias_linear"])
    assert llama["untie_embeddings_and_output_weights"] and "num_experts" not in llama

    glm = flags_from_hf_config(load_hf_config(tiny_hf["glm4_moe"]))
    assert glm["moe_layer_freq"] == "([0]*1+[1]*2)"  # first_k_dense_replace=1
    assert glm["num_experts"] == 4 and glm["moe_router_topk"] == 2 and glm["moe_ffn_hidden_size"] == 64
    assert glm["ffn_hidden_size"] == 256 and glm["moe_shared_expert_intermediate_size"] == 64
    assert glm["moe_router_score_function"] == "sigmoid" and glm["moe_router_enable_expert_bias"]
    assert glm["moe_router_topk_scaling_factor"] == 1.0
    assert glm["moe_router_num_groups"] == 1 and glm["moe_router_group_topk"] == 1
    assert glm["rotary_percent"] == 0.5 and glm["rotary_base"] == 1000000 and not glm["use_rope_scaling"]
    assert glm["add_qkv_bias"] and not glm["add_bias_linear"] and not glm["qk_layernorm"]
    assert glm["untie_embeddings_and_output_weights"]


@pytest.mark.parametrize("kind", ["llama", "glm4_moe"])
def test_every_tiny_llama_and_glm45_tensor_maps_to_megatron_and_back(tiny_hf, kind):
    from safetensors.torch import load_file

    hf = load_file(Path(tiny_hf[kind]) / "model.safetensors")
    flags = flags_from_hf_config(load_hf_config(tiny_hf[kind]))
    shape = AttentionShape(flags["num_attention_heads"], flags["num_query_groups"], flags["kv_channels"])
    mcore = {hf_mapping.mcore_name(n) for n in hf}
    again = {}
    for name in mcore:
        names, layout = hf_mapping.hf_names(name)
        full = hf_mapping.to_mcore(layout, [hf[n] for n in names], shape)
        again.update(zip(names, hf_mapping.to_hf(layout, full, shape), strict=True))
    assert sorted(again) == sorted(hf)
    assert all(torch.equal(again[n], t) for n, t in hf.items())
    if kind == "glm4_moe":  # layer 0 dense; layers 1-2: router with expert bias, 4 experts, a shared expert
        assert "decoder.layers.0.mlp.linear_fc1.weight" in mcore
        assert not any(n.startswith("decoder.layers.0.mlp.router") for n in mcore)
        moe = {n.split(".", 3)[3] for n in mcore if n.startswith("decoder.layers.2.mlp.")}
        assert moe == {
            "mlp.router.weight", "mlp.router.expert_bias", "mlp.shared_experts.linear_fc1.weight",
            "mlp.shared_experts.linear_fc2.weight",
            *(f"mlp.experts.local_experts.{e}.linear_fc{i}.weight" for e in range(4) for i in (1, 2)),
        }  # fmt: skip
        assert "decoder.layers.1.self_attention.linear_qkv.bias" in mcore
