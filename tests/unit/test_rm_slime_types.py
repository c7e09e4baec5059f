"""slime's reward types beyond math/gsm8k/f1: deepscaler, dapo, gpqa, random, boxed_<type>, per-sample rm_type, and
the parse-time check of --rm-type; hand-made cases, and the GSM8K test split where it applies."""

from __future__ import annotations

import asyncio
import json
import os
import random
import types
from pathlib import Path

import pytest

from vime.rollout.rm_hub import async_rm, check_rm_type
from vime.rollout.rm_hub.dapo import compute_dapo_reward, normalize_answer
from vime.rollout.rm_hub.deepscaler import compute_deepscaler_reward
from vime.rollout.rm_hub.gpqa import compute_gpqa_reward
from vime.utils.types import Sample


def _rm(rm_type, response, label, metadata=None):
    args = types.SimpleNamespace(rm_type=rm_type, custom_rm_path=None, rm_url=None)
    return asyncio.run(async_rm(args, Sample(response=response, label=label, metadata=metadata or {})))


def test_deepscaler_scores_only_the_boxed_answer_after_the_reasoning():
    assert compute_deepscaler_reward(r"<think>maybe \boxed{3}</think> so \boxed{\frac{1}{2}}", "0.5") == 1.0
    assert (
        compute_deepscaler_reward(r"<think>\boxed{0.5}</think> the answer is 0.5", "0.5") == 0.0
    )  # no box after
    assert compute_deepscaler_reward(r"\boxed{0.5}", "0.5") == 0.0  # no </think> and no ###Response
    assert compute_deepscaler_reward(r"###Response: \boxed{7}", r"the answer is $\boxed{7}$") == 1.0
    assert compute_deepscaler_reward(r"</think>\boxed{7}", "") == 0.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [("18", "18"), (" $1,234$ dollars.", "1234"), (r"\boxed{42}", "42"), ("x = 7", "7"), ("12.0", "12.0"),
     (r"\text{5 apples}", "5apples"), ("45^\\circ", "45"), (r"\frac12", r"\frac{1}{2}")],  # Minerva's rules, as slime
)  # fmt: skip
def test_dapo_normalization(text, expected):
    assert normalize_answer(text) == expected


def test_dapo_reads_the_last_answer_line_and_scores_plus_or_minus_one():
    right = compute_dapo_reward("work...\nAnswer: 12\nmore\nAnswer: $1,024$", "1024")
    assert right == {"score": 1.0, "acc": True, "pred": "1024"}
    wrong = compute_dapo_reward("Answer: 1023", "1024")
    assert wrong["score"] == -1.0 and wrong["acc"] is False
    assert compute_dapo_reward("no answer line", "5")["pred"] == "[INVALID]"
    # only the last 300 characters count
    assert compute_dapo_reward("Answer: 5\n" + "x" * 400, "5")["score"] == -1.0


def test_gpqa_letters_indices_and_choice_text():
    meta = {"choices": ["red", "green", "blue", "black"]}
    assert compute_gpqa_reward("Reasoning... The answer is (C).", "C", meta) == 1.0
    assert compute_gpqa_reward("<think>A?</think> Answer: B", 1, meta) == 1.0  # label as an option index
    assert compute_gpqa_reward("Answer: B", "blue", meta) == 0.0  # label as the option's text: C
    assert compute_gpqa_reward("It must be blue.", "blue", meta) == 1.0  # no letter: text match
    assert compute_gpqa_reward("C is correct", "x", {**meta, "correct_letter": "c"}) == 1.0
    assert compute_gpqa_reward("I pick E", "A", meta) == 0.0  # E is not an option here: nothing chosen


def test_boxed_prefix_and_per_sample_rm_type():
    assert _rm("boxed_exact", r"blah \boxed{yes}", "yes") == 1.0
    assert _rm("boxed_exact", "yes", "yes") == 0.0  # nothing boxed
    assert _rm("exact", "x", "4", metadata={"rm_type": "boxed_gsm8k"}) == 0.0
    assert _rm(None, r"so \boxed{4} apples, 9 pears", "4", metadata={"rm_type": "boxed_gsm8k"}) == 1.0
    random.seed(0)
    assert {_rm("random", "", None) for _ in range(20)} == {0.0, 1.0}


def test_check_rm_type_names_the_problem():
    assert check_rm_type("boxed_f1") == "boxed_f1"
    with pytest.raises(ValueError, match="unknown --rm-type 'deepscalar'"):
        check_rm_type("deepscalar")
    with pytest.raises(ValueError, match="boxed_<type> with a type that reads the whole response"):
        check_rm_type("boxed_math")


def test_parse_time_check_of_rm_type(capsys):
    from vime.utils.arguments import parse_args

    base = ["--train-backend", "fsdp", "--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "1"]  # fmt: skip
    with pytest.raises(SystemExit):
        parse_args([*base, "--rm-type", "ifbench"])
    assert "IFBench" in capsys.readouterr().err
    assert parse_args([*base, "--rm-type", "deepscaler"]).rm_type == "deepscaler"
    assert parse_args([*base, "--rm-type", "nope", "--custom-rm-path", "m.f"]).rm_type == "nope"  # not used


def _gsm8k_rows():
    shared = os.environ.get("VIME_SHARED_DIR")
    path = (Path(shared) if shared else Path(__file__).resolve().parents[2].parent / "shared") / "data"
    path = path / "gsm8k_test.jsonl"
    if not path.exists():
        pytest.skip(f"GSM8K test set not found: {path} (set VIME_SHARED_DIR)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:300]


def test_gsm8k_answers_through_dapo_deepscaler_and_boxed_gsm8k():
    for row in _gsm8k_rows():
        number = row["answer"].rsplit("####", 1)[1].strip()
        assert compute_dapo_reward(f"{row['question'][:50]}\nAnswer: {number}", number)["acc"], number
        assert (
            compute_deepscaler_reward(f"</think>so it is $\\boxed{{{number}}}$", number.replace(",", ""))
            == 1.0
        )
        assert _rm("boxed_gsm8k", f"I guess 3, \\boxed{{{number}}}", row["answer"]) == 1.0, number
        assert compute_dapo_reward(f"Answer: {int(number.replace(',', '')) + 1}", number)["score"] == -1.0
