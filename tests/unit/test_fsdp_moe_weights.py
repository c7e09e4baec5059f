"""FSDP weight buckets and HF export in the checkpoint format (one rank, gloo on CPU, fp32).

transformers fuses a Mixture-of-Experts model's experts in memory (``mlp.experts.gate_up_proj`` [E, 2I, H]) while
checkpoints and vLLM name them per expert (``mlp.experts.{e}.gate_proj.weight``): weight sync and HF export must
emit what ``save_pretrained`` writes, for MoE and dense models alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.core_model_loading import Chunk, WeightConverter

from vime.backends.fsdp_utils.checkpoint import load_weights
from vime.backends.fsdp_utils.trainer import FSDPTrainer
from vime.backends.fsdp_utils.weights import checkpoint_format, hf_weight_names, stacked_suffixes
from vime.tools.make_tiny_model import VOCAB_SIZE, build_tiny_model, build_tokenizer
from vime.utils.arguments import parse_args
from vime.utils.stacked_experts import expand_stacked, parse_stacked

SIZES = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    head_dim=32, max_position_embeddings=64,
)  # fmt: skip


def save_model(model: PreTrainedModel, out: Path) -> Path:
    """``save_pretrained`` (the checkpoint-format reference) plus the tiny char tokenizer, for ``export_hf``."""
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    config = Qwen3MoeConfig(
        **SIZES, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return save_model(Qwen3MoeForCausalLM(config), tmp_path_factory.mktemp("moe") / "model")


def trainer_for(model_dir: Path) -> FSDPTrainer:
    args = parse_args(
        [
            "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-rollout", "4",
        ]
    )  # fmt: skip
    return FSDPTrainer(args)


def safetensors_of(model_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def synced_weights(buckets: list[list[tuple[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    pairs = [pair for bucket in buckets for pair in bucket]
    weights = dict(pairs)
    assert len(weights) == len(pairs), "a name is sent twice"
    return weights


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_moe_weight_buckets_are_in_checkpoint_format(moe_dir):
    trainer = trainer_for(moe_dir)
    limit = 16 * 1024  # bytes: several buckets, a fused expert tensor (4x64x64 fp32 = 64 KB) split over them
    buckets = list(trainer.iter_weight_buckets(limit))
    assert len(buckets) > 1
    for bucket in buckets:
        assert len(bucket) == 1 or sum(t.numel() * t.element_size() for _, t in bucket) <= limit
    saved = safetensors_of(moe_dir)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in saved  # the reference is per expert
    assert_same_tensors(synced_weights(buckets), saved)


def test_stacked_moe_weight_buckets_send_fused_experts_as_is(moe_dir):
    """Weight sync's stacked experts: transformers' in-memory ``gate_up_proj``/``down_proj`` under their stacked keys
    (no per-expert split), which expand to exactly the checkpoint's per-expert tensors."""
    trainer = trainer_for(moe_dir)
    synced = synced_weights(list(trainer.iter_weight_buckets(16 * 1024, stack_experts=True)))
    stacked = {n: t for n, t in synced.items() if parse_stacked(n)}
    assert sorted(stacked) == [
        f"model.layers.{i}.mlp.experts.vime_stacked_{p}" for i in (0, 1) for p in ("w13", "w2")
    ]
    in_memory = trainer.model.model.layers[1].mlp.experts
    assert torch.equal(
        stacked["model.layers.1.mlp.experts.vime_stacked_w13"], in_memory.gate_up_proj.full_tensor().detach()
    )
    assert_same_tensors(dict(expand_stacked(synced.items())), safetensors_of(moe_dir))


def test_transposed_fused_experts_are_not_stacked():
    """A model whose in-memory experts are not vime's stacked layout (qwen3_vl_moe keeps them transposed)."""
    qwen3_moe = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            **SIZES, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2
        )
    )
    assert stacked_suffixes(qwen3_moe) == {"mlp.experts.gate_up_proj": "w13", "mlp.experts.down_proj": "w2"}
    qwen3_moe.config.model_type = "qwen3_vl_moe"
    assert stacked_suffixes(qwen3_moe) == {}


def test_moe_export_hf_is_in_checkpoint_format_and_loads(moe_dir, tmp_path):
    out = tmp_path / "hf"
    trainer_for(moe_dir).export_hf(str(out))
    assert_same_tensors(safetensors_of(out), safetensors_of(moe_dir))
    tokens = torch.randint(0, VOCAB_SIZE, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [
            AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)(tokens).logits
            for d in (out, moe_dir)
        ]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def test_moe_checkpoint_loads_as_weights(moe_dir, tmp_path):
    """``--ref-load``-style weight loading of a per-expert HF directory into an MoE model."""
    trainer = trainer_for(moe_dir)
    torch.manual_seed(1)
    other = save_model(
        Qwen3MoeForCausalLM(Qwen3MoeForCausalLM.config_class.from_pretrained(moe_dir)), tmp_path / "m"
    )
    load_weights(trainer.model, other)
    assert_same_tensors(synced_weights(list(trainer.iter_weight_buckets(1 << 30))), safetensors_of(other))


def tied_dense_dir(out: Path) -> Path:
    torch.manual_seed(0)
    config = Qwen3Config(**SIZES, intermediate_size=128, tie_word_embeddings=True)
    return save_model(Qwen3ForCausalLM(config), out)


@pytest.mark.parametrize(
    "build", [lambda out: build_tiny_model(out, seed=0, task=None), tied_dense_dir], ids=["untied", "tied"]
)
def test_dense_weight_buckets_are_unchanged(build, tmp_path):
    model_dir = build(tmp_path / "model")
    trainer = trainer_for(model_dir)
    synced = synced_weights(list(trainer.iter_weight_buckets(1 << 30)))
    assert_same_tensors(synced, safetensors_of(model_dir))  # a tied lm_head.weight is not sent, as not saved
    assert list(synced) == hf_weight_names(trainer.model)  # the in-memory names, in order


def test_a_many_to_one_conversion_is_refused():
    model = Qwen3ForCausalLM(Qwen3Config(**SIZES, intermediate_size=128))
    # as if loaded from a checkpoint with a fused gate_up_proj that transformers splits in memory
    model._weight_conversions = [
        WeightConverter(
            "mlp.gate_up_proj.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [Chunk(dim=0)]
        )
    ]
    with pytest.raises(NotImplementedError, match="several in-memory tensors"):
        list(checkpoint_format(model, model.state_dict().items()))
