"""The new model families on the Megatron side without Megatron: slime's model scripts parse unmodified and match their
checkpoints' configs, the flags of the tiny models, and every tensor of them mapped to Megatron and back (with
multi-latent attention's names). With Megatron-Core (GPU machine): tests/gpu/test_megatron_gpu.py."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vime.backends.megatron_utils import hf_mapping
from vime.backends.megatron_utils.hf_config import (
    check_hf_config,
    flags_from_hf_config,
    flags_to_argv,
    load_hf_config,
)
from vime.backends.megatron_utils.hf_mapping import AttentionShape
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils import backend_flags

REPO = Path(__file__).resolve().parents[2]


def megatron_args(argv: list[str]) -> argparse.Namespace:
    from vime.utils.megatron_args import add_megatron_arguments

    parser = argparse.ArgumentParser()
    add_megatron_arguments(parser)
    return parser.parse_args(argv)


def model_args(script: str) -> list[str]:
    """MODEL_ARGS of ``scripts/models/<script>``, as bash expands them."""
    path = REPO / "scripts" / "models" / script
    out = subprocess.run(
        ["bash", "-c", f'source "{path}"; printf "%s\\0" "${{MODEL_ARGS[@]}}"'],
        capture_output=True,
        check=True,
    )
    return out.stdout.decode().split("\0")[:-1]


# the checkpoints' config.json (the fields the flags depend on)
QWEN25 = dict(
    model_type="qwen2", hidden_act="silu", rope_theta=1000000.0, rms_norm_eps=1e-6, use_sliding_window=False,
    max_position_embeddings=32768,
)  # fmt: skip
QWEN25_0_5B = QWEN25 | dict(
    num_hidden_layers=24, hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
    tie_word_embeddings=True, vocab_size=151936,
)  # fmt: skip
QWEN25_7B = QWEN25 | dict(
    num_hidden_layers=28, hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
    tie_word_embeddings=False, vocab_size=152064,
)  # fmt: skip
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", num_hidden_layers=61, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3,
    norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", rms_norm_eps=1e-6, hidden_act="silu",
    rope_theta=10000, max_position_embeddings=163840, tie_word_embeddings=False, vocab_size=129280,
    attention_bias=False, num_nextn_predict_layers=1,
    rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096},
)  # fmt: skip
# Kimi-K2-Instruct: DeepSeek-V3's architecture with 384 experts in one group, 64 heads, YaRN with beta 1/1
KIMI_K2 = DEEPSEEK_V3 | dict(
    model_type="kimi_k2", num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384, n_group=1,
    topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1, rope_theta=50000.0, vocab_size=163840,
    max_position_embeddings=131072,
    rope_scaling={"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
)  # fmt: skip

SLIME_SCRIPTS = [
    "deepseek-v3.sh", "kimi-k2.sh", "qwen3-next-80B-A3B.sh", "qwen2.5-0.5B.sh", "qwen2.5-1.5B.sh", "qwen2.5-3B.sh",
    "qwen2.5-7B.sh", "qwen2.5-32B.sh",
]  # fmt: skip


@pytest.mark.parametrize("script", SLIME_SCRIPTS)
def test_slimes_model_scripts_parse_unmodified(script):
    args = megatron_args(model_args(script))
    assert args.num_layers and args.hidden_size and args.transformer_impl == "local"


@pytest.mark.parametrize(
    "script,config",
    [("qwen2.5-0.5B.sh", QWEN25_0_5B), ("qwen2.5-7B.sh", QWEN25_7B), ("deepseek-v3.sh", DEEPSEEK_V3)],
)
def test_slimes_scripts_match_their_checkpoints(script, config):
    check_hf_config(megatron_args(model_args(script)), config)
    flags = flags_from_hf_config(config)
    check_hf_config(megatron_args(flags_to_argv(flags)), config)  # and what vime derives from the config


def test_deepseek_v3_flags():
    flags = flags_from_hf_config(DEEPSEEK_V3)
    assert flags["multi_latent_attention"] and flags["qk_layernorm"] and "kv_channels" not in flags
    assert (flags["q_lora_rank"], flags["kv_lora_rank"], flags["qk_head_dim"], flags["qk_pos_emb_head_dim"]) == (
        1536, 512, 128, 64
    )  # fmt: skip
    assert (
        flags["rope_type"] == "yarn"
        and flags["rotary_scaling_factor"] == 40
        and flags["mscale_all_dim"] == 1.0
    )
    assert flags["moe_layer_freq"] == "([0]*3+[1]*58)" and flags["moe_router_topk_scaling_factor"] == 2.5
    assert (flags["moe_router_num_groups"], flags["moe_router_group_topk"]) == (8, 4)
    assert (
        "moe_router_pre_softmax" not in flags
    )  # Megatron ignores it with sigmoid scores (slime's script sets it)


def test_kimi_k2s_yarn_betas_are_not_megatrons_defaults():
    """slime's kimi-k2.sh leaves YaRN's betas at Megatron's 32/1; Kimi-K2's config has 1/1, which changes the RoPE
    frequencies: the start-up check names the flags to add."""
    argv = model_args("kimi-k2.sh")
    with pytest.raises(ValueError, match=r"--yarn-beta-fast=32.0 but config.json implies 1.0"):
        check_hf_config(megatron_args(argv), KIMI_K2)
    check_hf_config(megatron_args(argv + ["--yarn-beta-fast", "1", "--yarn-beta-slow", "1"]), KIMI_K2)


def test_routing_and_rope_megatron_cannot_reproduce_are_refused():
    # Megatron scores an expert group by its best top-k / topk_group experts, transformers by its best 2
    with pytest.raises(ValueError, match="best 2 experts"):
        flags_from_hf_config(DEEPSEEK_V3 | dict(num_experts_per_tok=4))
    with pytest.raises(ValueError, match="interleaved RoPE"):
        flags_from_hf_config(DEEPSEEK_V3 | dict(rope_interleave=False))
    with pytest.raises(ValueError, match="without query compression"):
        flags_from_hf_config(DEEPSEEK_V3 | dict(q_lora_rank=None))
    # transformers scales cos/sin by mscale(factor) when mscale is unset; Megatron's ratio cannot say that
    no_mscale = DEEPSEEK_V3["rope_scaling"] | {"mscale": 0.0}
    with pytest.raises(ValueError, match="no Megatron --mscale"):
        flags_from_hf_config(DEEPSEEK_V3 | dict(rope_scaling=no_mscale))
    with pytest.raises(ValueError, match="use_sliding_window"):
        flags_from_hf_config(QWEN25_7B | dict(use_sliding_window=True))
    with pytest.raises(ValueError, match="gated DeltaNet"):
        flags_from_hf_config({"model_type": "qwen3_next"})


def test_qwen3_next_flags_parse_and_megatron_refuses_them_with_the_reason():
    args = megatron_args(model_args("qwen3-next-80B-A3B.sh"))
    assert (
        args.attention_output_gate
        and args.apply_layernorm_1p
        and args.spec
        == [
            "slime_plugins.models.qwen3_next",
            "get_qwen3_next_spec",
        ]
    )
    args.train_backend, args.spec = "megatron", None
    with pytest.raises(
        ValueError, match="--apply-layernorm-1p, --attention-output-gate, --use-gated-attention, "
    ):
        backend_flags._check_model_family_flags(args)
    args.spec = ["slime_plugins.models.qwen3_next", "get_qwen3_next_spec"]
    with pytest.raises(ValueError, match="--spec slime_plugins.models.qwen3_next get_qwen3_next_spec"):
        backend_flags._check_model_family_flags(args)
    args.train_backend = "fsdp"  # the fsdp backend builds transformers' class from config.json
    backend_flags._check_model_family_flags(args)


# ----------------------------------------------------------------------------------------------- the tiny models
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {arch: build_tiny_model(root / arch, arch=arch, task=None) for arch in ("qwen2", "deepseek_v3")}


def test_tiny_model_flags(tiny):
    qwen2 = flags_from_hf_config(load_hf_config(tiny["qwen2"]))
    assert qwen2["add_qkv_bias"] and not qwen2["qk_layernorm"] and qwen2["rotary_base"] == 1000000
    assert not qwen2["multi_latent_attention"] and qwen2["kv_channels"] == 64
    ds = flags_from_hf_config(load_hf_config(tiny["deepseek_v3"]))
    assert ds["multi_latent_attention"] and ds["kv_lora_rank"] == 512 and ds["q_lora_rank"] == 96
    assert ds["moe_layer_freq"] == "([0]*1+[1]*2)" and ds["num_experts"] == 8 and ds["moe_router_topk"] == 4
    assert ds["yarn_original_max_position_embeddings"] == 4096 and ds["rotary_scaling_factor"] == 40.0
    for model in tiny.values():
        config = load_hf_config(model)
        check_hf_config(megatron_args(flags_to_argv(flags_from_hf_config(config))), config)


@pytest.mark.parametrize("arch", ["qwen2", "deepseek_v3"])
def test_every_tiny_model_tensor_maps_to_megatron_and_back(tiny, arch):
    hf = load_file(tiny[arch] / "model.safetensors")
    flags = flags_from_hf_config(load_hf_config(tiny[arch]))
    mla = flags["multi_latent_attention"]
    shape = AttentionShape(
        flags["num_attention_heads"], flags["num_query_groups"], flags.get("kv_channels", 1)
    )
    mcore = {hf_mapping.mcore_name(n, mla) for n in hf}
    again = {}
    for name in mcore:
        names, layout = hf_mapping.hf_names(name, mla)
        full = hf_mapping.to_mcore(layout, [hf[n] for n in names], shape)
        again.update(zip(names, hf_mapping.to_hf(layout, full, shape), strict=True))
    assert sorted(again) == sorted(hf)
    assert all(torch.equal(again[n], t) for n, t in hf.items())
    attention = {n.split(".", 3)[3] for n in mcore if n.startswith("decoder.layers.1.self_attention.")}
    if arch == "qwen2":
        assert "self_attention.linear_qkv.bias" in attention
        return
    assert attention == {
        f"self_attention.{name}.weight"
        for name in ("linear_q_down_proj", "q_layernorm", "linear_q_up_proj", "linear_kv_down_proj", "kv_layernorm",
                     "linear_kv_up_proj", "linear_proj")
    }  # fmt: skip
    assert "decoder.layers.0.mlp.linear_fc1.weight" in mcore  # the first layer is dense
    assert {
        "decoder.layers.2.mlp.router.expert_bias",
        "decoder.layers.2.mlp.shared_experts.linear_fc1.weight",
    } < mcore


def test_mla_names_do_not_change_the_other_families():
    assert hf_mapping.hf_names("decoder.layers.0.self_attention.q_layernorm.weight") == (
        ["model.layers.0.self_attn.q_norm.weight"], "plain"
    )  # fmt: skip
    assert hf_mapping.hf_names("decoder.layers.0.self_attention.q_layernorm.weight", mla=True) == (
        ["model.layers.0.self_attn.q_a_layernorm.weight"], "plain"
    )  # fmt: skip
    # without query compression (DeepSeek-V2-Lite style) q_proj is MLA's linear_q_proj, not part of a fused qkv
    assert hf_mapping.mcore_name("model.layers.4.self_attn.q_proj.weight", mla=True) == (
        "decoder.layers.4.self_attention.linear_q_proj.weight"
    )
    assert hf_mapping.mcore_name("model.layers.4.self_attn.q_proj.weight") == (
        "decoder.layers.4.self_attention.linear_qkv.weight"
    )


@pytest.mark.parametrize("arch", ["qwen2", "deepseek_v3"])
def test_tiny_model_flags_pass_vimes_validation(tiny, arch, monkeypatch):
    from vime.utils import arg_validation
    from vime.utils.arguments import parse_args

    # parse_args refuses --train-backend megatron without megatron-core and CUDA; everything else is checked
    monkeypatch.setattr(arg_validation, "_check_backend", lambda args: None)
    config = load_hf_config(tiny[arch])
    args = parse_args(
        ["--train-backend", "megatron", "--hf-checkpoint", str(tiny[arch]), "--prompt-data", "unused.jsonl",
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
         *flags_to_argv(flags_from_hf_config(config))]
    )  # fmt: skip
    check_hf_config(args, config)  # the trainer's start-up check
