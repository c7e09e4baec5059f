"""Megatron-named flags per backend (issue 22): each is read, mapped to what the backend has, or refused with the
reason — recompute, the distributed optimizer, the attention backend, the layer implementation, fp32 gradient
reduction and the MoE token-drop policy."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from vime.backends.fsdp_utils.model import checkpointed_layers, enable_activation_checkpointing
from vime.backends.megatron_utils.config import ddp_config_kwargs, transformer_config_kwargs
from vime.utils import arg_validation
from vime.utils.arguments import build_parser
from vime.utils.backend_flags import check_backend_flags

BASE = (
    "--hf-checkpoint /m --prompt-data /d.jsonl --rollout-batch-size 2 --n-samples-per-prompt 2 --num-rollout 1 "
    "--num-layers 4 --hidden-size 16 --num-attention-heads 2 --normalization RMSNorm --swiglu"
).split()
FULL_EVERY_LAYER = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()


def parse(backend: str, *flags: str) -> argparse.Namespace:
    """Parse and validate; ``--train-backend megatron`` without its install check (no megatron-core on CPU)."""
    args = build_parser().parse_args([*BASE, "--train-backend", backend, *flags])
    if backend == "megatron":
        check_backend_flags(args)
        return args
    arg_validation.finalize_args(args)
    return args


def refusal(backend: str, *flags: str) -> str:
    with pytest.raises(ValueError) as info:
        parse(backend, *flags)
    return str(info.value)


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_attention_backends_vime_runs_are_accepted_with_one_info_line(backend, caplog):
    with caplog.at_level(logging.INFO, logger="vime.utils.backend_flags"):
        parse(backend, "--attention-backend", "flash")
    lines = [r.getMessage() for r in caplog.records if r.name == "vime.utils.backend_flags"]
    assert len(lines) == 1 and "--attention-backend flash" in lines[0] and "FlashAttention-2" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vime.utils.backend_flags"):
        parse(backend, "--attention-backend", "auto")
        parse(backend)
    assert not [r for r in caplog.records if r.name == "vime.utils.backend_flags"]


@pytest.mark.parametrize("value", ["fused", "unfused"])
def test_transformer_engine_attention_backends_are_refused(value):
    message = refusal("megatron", "--attention-backend", value)
    assert (
        f"--attention-backend {value}: TransformerEngine" in message
        and "--attention-backend flash" in message
    )


def test_transformer_engine_layers_are_refused_and_local_is_the_default():
    assert parse("megatron").transformer_impl == "local"
    message = refusal("megatron", "--transformer-impl", "transformer_engine")
    assert "--transformer-impl transformer_engine" in message and "--transformer-impl local" in message


def test_fsdp_maps_full_recompute_of_every_layer_and_of_the_first_n():
    assert checkpointed_layers(parse("fsdp"), 4) == 0
    assert checkpointed_layers(parse("fsdp", *FULL_EVERY_LAYER), 4) == 4
    assert checkpointed_layers(parse("fsdp", "--gradient-checkpointing"), 4) == 4
    block = "--recompute-granularity full --recompute-method block --recompute-num-layers".split()
    assert checkpointed_layers(parse("fsdp", *block, "2"), 4) == 2
    assert checkpointed_layers(parse("fsdp", *block, "9"), 4) == 4


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--recompute-granularity", "selective"],
            "--recompute-granularity selective: Megatron's recompute of",
        ),
        (
            [*FULL_EVERY_LAYER[:-1], "2"],
            "--recompute-method uniform --recompute-num-layers 2: the fsdp backend checkpoints each decoder layer",
        ),
    ],
)
def test_fsdp_refuses_recompute_it_cannot_do(flags, expected):
    assert expected in refusal("fsdp", *flags)


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--recompute-granularity", "full"], "Megatron-Core needs both, a method (uniform or block)"),
        (["--recompute-method", "uniform"], "--recompute-method uniform: these choose the layers of"),
        (["--recompute-num-layers", "2"], "add --recompute-granularity full or drop them"),
        (["--gradient-checkpointing", "--recompute-granularity", "selective"], "pass one of them"),
    ],
)
def test_recompute_flags_megatron_core_refuses_or_ignores_are_refused_on_both(backend, flags, expected):
    assert expected in refusal(backend, *flags)


def test_gradient_checkpointing_is_full_recompute_of_every_layer_on_megatron_too():
    kwargs = transformer_config_kwargs(parse("megatron", "--gradient-checkpointing"))
    assert (kwargs["recompute_granularity"], kwargs["recompute_method"], kwargs["recompute_num_layers"]) == (
        "full",
        "uniform",
        1,
    )
    kwargs = transformer_config_kwargs(parse("megatron", "--recompute-granularity", "selective"))
    assert (kwargs["recompute_granularity"], kwargs["recompute_method"]) == ("selective", None)


def test_distributed_optimizer_on_fsdp_says_fsdp_already_shards_the_optimizer_state(caplog):
    with caplog.at_level(logging.INFO, logger="vime.utils.backend_flags"):
        parse("fsdp", "--use-distributed-optimizer")
    assert "--use-distributed-optimizer: the fsdp backend always shards the optimizer state" in caplog.text
    assert ddp_config_kwargs(parse("megatron", "--use-distributed-optimizer"))["use_distributed_optimizer"]


def test_accumulate_allreduce_grads_in_fp32_is_megatron_ddps_grad_reduce_in_fp32():
    def reduces_in_fp32(*flags: str) -> bool:
        return ddp_config_kwargs(parse("megatron", *flags))["grad_reduce_in_fp32"]

    assert not reduces_in_fp32()  # fp32 parameters: the gradients are fp32 anyway
    assert reduces_in_fp32("--accumulate-allreduce-grads-in-fp32")
    assert reduces_in_fp32("--bf16")  # Megatron-LM's rule: always with bf16


def test_moe_token_drop_policy_reaches_the_transformer_config():
    moe = "--num-experts 4 --moe-ffn-hidden-size 8 --moe-router-topk 2".split()
    assert transformer_config_kwargs(parse("megatron", *moe))["moe_token_drop_policy"] == "probs"
    kwargs = transformer_config_kwargs(parse("megatron", *moe, "--moe-token-drop-policy", "position"))
    assert kwargs["moe_token_drop_policy"] == "position"


MLA = "--multi-latent-attention --q-lora-rank 8 --qk-layernorm --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 8 --v-head-dim 8".split()


def test_multi_latent_attention_under_tensor_parallelism_needs_sequence_parallelism():
    with pytest.raises(ValueError, match="needs --sequence-parallel"):
        transformer_config_kwargs(parse("megatron", *MLA, "--tensor-model-parallel-size", "2"))
    tp2_sp = transformer_config_kwargs(
        parse("megatron", *MLA, "--tensor-model-parallel-size", "2", "--sequence-parallel")
    )
    assert tp2_sp["multi_latent_attention"] and tp2_sp["sequence_parallel"]
    assert transformer_config_kwargs(parse("megatron", *MLA))["q_lora_rank"] == 8  # one TP rank


@pytest.mark.parametrize(("flags", "recomputed"), [([], []), (FULL_EVERY_LAYER, [0, 1, 2]), (
    "--recompute-granularity full --recompute-method block --recompute-num-layers 2".split(), [0, 1])])  # fmt: skip
def test_fsdp_recomputes_exactly_the_checkpointed_layers_in_backward(flags, recomputed):
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config)
    layers = list(model.model.layers)
    enable_activation_checkpointing(model, layers, parse("fsdp", *flags))
    calls = [0] * len(layers)
    # a pre-hook: recompute stops early, once backward has what it needs
    for index, layer in enumerate(layers):
        layer.input_layernorm.register_forward_pre_hook(
            lambda *_, i=index: calls.__setitem__(i, calls[i] + 1)
        )
    model.train()
    model(torch.arange(8).unsqueeze(0)).logits.sum().backward()
    assert [i for i, n in enumerate(calls) if n == 2] == recomputed
    assert all(n in (1, 2) for n in calls)


@pytest.mark.parametrize(
    "flags",
    [
        ["--expert-tensor-parallel-size", "2"],
        ["--custom-megatron-init-path", "m.init"],
        ["--custom-megatron-before-log-prob-hook-path", "m.hook"],
        ["--custom-megatron-before-train-step-hook-path", "m.hook"],
        ["--megatron-config-path", "roles.yaml"],
    ],
)
def test_fsdp_refuses_megatron_parallelism_hooks_and_role_config_it_would_ignore(flags):
    message = refusal("fsdp", *flags)
    assert flags[0] in message and "--train-backend megatron" in message
    check_backend_flags(build_parser().parse_args([*BASE, "--train-backend", "megatron", *flags]))
