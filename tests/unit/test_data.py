"""Prompt data loading: formats, slicing, keys, chat templates, length filter, shuffling, bad input."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vime.tools.make_tiny_model import build_tokenizer
from vime.utils.data import DataError, DataSpec, load_prompt_dataset


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"prompt": f"{n}+3=", "label": str((n + 3) % 10), "metadata": {"n": n}} for n in range(10)]


def test_jsonl_loads_prompts_labels_metadata_and_tokens(tmp_path, tokenizer):
    data = load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", ROWS), tokenizer)
    assert len(data) == 10
    sample = data.samples[7]
    assert (sample.index, sample.prompt, sample.label, sample.metadata) == (7, "7+3=", "0", {"n": 7})
    assert tokenizer.decode(sample.tokens) == "7+3=" and sample.response_length == 0


def test_parquet_matches_jsonl(tmp_path, tokenizer):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    from_parquet = load_prompt_dataset(str(tmp_path / "d.parquet"), tokenizer)
    from_jsonl = load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", ROWS), tokenizer)
    assert [s.to_dict() for s in from_parquet.samples] == [s.to_dict() for s in from_jsonl.samples]


@pytest.mark.parametrize(
    ("suffix", "expected"),
    [
        ("@[2:5]", [2, 3, 4]),
        ("@[:3]", [0, 1, 2]),
        ("@[8:]", [8, 9]),
        ("@[-2:]", [8, 9]),
        ("@[:]", list(range(10))),
    ],
)
def test_slicing(tmp_path, tokenizer, suffix, expected):
    data = load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", ROWS) + suffix, tokenizer)
    assert [s.index for s in data.samples] == expected
    assert [s.prompt for s in data.samples] == [f"{n}+3=" for n in expected]


@pytest.mark.parametrize(
    ("suffix", "message"),
    [
        ("@[3:11]", "slice end 11 is out of range for a file of 10 rows"),
        ("@[12:]", "slice start 12 is out of range"),
        ("@[5:5]", "selects no rows (the file has 10)"),
        ("@[a:b]", "bad slice"),
    ],
)
def test_slice_errors(tmp_path, tokenizer, suffix, message):
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", ROWS) + suffix, tokenizer)


def test_malformed_json_names_file_line_and_text(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "label": "1"}\n\n{"prompt": "b", "label": 2,,}\n')
    with pytest.raises(DataError) as exc:
        load_prompt_dataset(str(path), tokenizer)
    assert f"{path}:3: malformed JSON" in str(exc.value) and '{"prompt": "b", "label": 2,,}' in str(exc.value)


def test_non_object_line(tmp_path, tokenizer):
    path = tmp_path / "list.jsonl"
    path.write_text('{"prompt": "a", "label": "1"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"list.jsonl:2: expected a JSON object per line, got list"):
        load_prompt_dataset(str(path), tokenizer)


def test_missing_key_names_key_line_and_existing_keys(tmp_path, tokenizer):
    rows = [{"prompt": "1+3=", "label": "4"}, {"question": "2+3=", "answer": "5"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError) as exc:
        load_prompt_dataset(path, tokenizer)
    assert "d.jsonl:2: missing key 'prompt' (set by --input-key)" in str(exc.value)
    assert "['answer', 'question']" in str(exc.value)
    with pytest.raises(DataError, match=r"d.jsonl:1: missing key 'answer' \(set by --label-key\)"):
        load_prompt_dataset(path, tokenizer, input_key="prompt", label_key="answer")


def test_other_keys_are_honoured(tmp_path, tokenizer):
    rows = [{"question": "2+3=", "answer": "5", "extra": {"k": 1}}]
    data = load_prompt_dataset(
        write_jsonl(tmp_path / "d.jsonl", rows),
        tokenizer,
        input_key="question",
        label_key="answer",
        metadata_key="extra",
    )
    assert (data.samples[0].prompt, data.samples[0].label, data.samples[0].metadata) == (
        "2+3=",
        "5",
        {"k": 1},
    )


def test_empty_file_and_missing_file(tmp_path, tokenizer):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="the file has no rows"):
        load_prompt_dataset(str(tmp_path / "empty.jsonl"), tokenizer)
    with pytest.raises(DataError, match="prompt file not found"):
        load_prompt_dataset(str(tmp_path / "nope.jsonl"), tokenizer)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load_prompt_dataset(str(tmp_path / "d.csv"), tokenizer)


def test_chat_template_on_strings_and_multi_turn_messages(tmp_path, tokenizer):
    rows = [
        {"prompt": "1+3=", "label": "4"},
        {
            "prompt": [
                {"role": "system", "content": "add"},
                {"role": "user", "content": "1+3="},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "2+3="},
            ],
            "label": "5",
        },
    ]
    data = load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, apply_chat_template=True)
    assert data.samples[0].prompt == "<|im_start|>user\n1+3=<|im_end|>\n<|im_start|>assistant\n"
    assert data.samples[1].prompt == (
        "<|im_start|>system\nadd<|im_end|>\n<|im_start|>user\n1+3=<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n"
    )
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert data.samples[0].tokens[0] == im_start  # special tokens are single ids, not spelled out
    assert tokenizer.decode(data.samples[1].tokens) == data.samples[1].prompt


def test_messages_without_chat_template_or_malformed(tmp_path, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "label": "x"}]
    with pytest.raises(
        DataError, match=r"d.jsonl:1: the prompt is a list of chat messages; pass --apply-chat-template"
    ):
        load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer)
    rows = [{"prompt": [{"content": "hi"}], "label": "x"}]
    with pytest.raises(DataError, match="list of {'role', 'content'} messages"):
        load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, apply_chat_template=True)


def test_max_prompt_len_filter_is_counted_and_reported(tmp_path, tokenizer, caplog):
    rows = [{"prompt": "1" * n, "label": "x"} for n in (3, 8, 5, 12)]
    with caplog.at_level(logging.WARNING):
        data = load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, max_prompt_len=5)
    assert [s.index for s in data.samples] == [0, 2] and data.num_too_long == 2
    assert "dropped 2 of 4 prompts longer than the max prompt length, 5 tokens" in caplog.text
    with pytest.raises(DataError, match="no prompts left after dropping 4"):
        load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, max_prompt_len=2)


def test_shuffle_is_a_fixed_permutation_per_seed_and_epoch(tmp_path, tokenizer):
    data = load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", ROWS), tokenizer)
    assert data.epoch_order(0, seed=1, shuffle=False) == list(range(10))
    first = data.epoch_order(0, seed=1, shuffle=True)
    assert sorted(first) == list(range(10)) and first != list(range(10))
    assert data.epoch_order(0, seed=1, shuffle=True) == first
    assert data.epoch_order(1, seed=1, shuffle=True) != first
    assert data.epoch_order(0, seed=2, shuffle=True) != first


def test_dataspec_parse():
    assert DataSpec.parse("a/b.jsonl") == DataSpec(path=__import__("pathlib").Path("a/b.jsonl"))
    spec = DataSpec.parse("x@y.jsonl@[1:-1]")
    assert (str(spec.path), spec.start, spec.end) == ("x@y.jsonl", 1, -1)
