"""Tests for vime.rollout.rm_hub: the built-in rewards and reward_samples' failure handling."""

from __future__ import annotations

import asyncio
import json
import os
import types
from pathlib import Path

import pytest
from aiohttp import web

from vime.rollout import rm_hub
from vime.rollout.rm_hub import async_rm, batched_async_rm, reward_samples
from vime.rollout.rm_hub.f1 import f1_score, normalize_answer
from vime.rollout.rm_hub.gsm8k import compute_gsm8k_reward, extract_final_number, parse_gsm8k_label
from vime.rollout.rm_hub.math_utils import compute_math_reward, extract_boxed
from vime.utils.misc import free_port
from vime.utils.types import Sample, Status


def _args(**kwargs):
    defaults = {
        "rm_type": None,
        "custom_rm_path": None,
        "group_rm": False,
        "rm_timeout": None,
        "rm_url": None,
    }
    return types.SimpleNamespace(**{**defaults, **kwargs})


def _rm(rm_type, response, label, **kwargs):
    return asyncio.run(async_rm(_args(rm_type=rm_type, **kwargs), Sample(response=response, label=label)))


# ---------------------------------------------------------------- math


def test_extract_boxed_handles_nested_braces_and_takes_the_last():
    assert extract_boxed(r"first \boxed{1} then \boxed{\frac{a^{2}}{b}} done") == r"\frac{a^{2}}{b}"
    # as slime reads it: \fbox and the brace-less \boxed 5 are no boxed answer
    assert extract_boxed(r"\fbox{7}") is None and extract_boxed(r"$\boxed 5$") is None
    assert extract_boxed(r"\boxed{1} and \boxed 5") is None  # the last \boxed decides
    assert extract_boxed(r"\boxed{\frac{1}{2}") is None  # unbalanced
    assert extract_boxed("no box") is None


@pytest.mark.parametrize(
    "response, label",
    [
        (r"so the answer is \boxed{\frac{1}{2}}", "0.5"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{1/2}", r"\frac12"),
        (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}"),
        (r"\boxed{42}", 42),
        (r"\boxed{3}", r"The solution gives \boxed{3}."),  # label that is itself a boxed solution
    ],
)
def test_math_equivalent_answers_score_one(response, label):
    assert _rm("math", response, label) == 1.0


@pytest.mark.parametrize(
    "response, label",
    [
        (r"\boxed{\frac{1}{3}}", "0.5"),
        (r"\boxed{2\sqrt{3}}", r"\sqrt{8}"),
        ("Reasoning...\nAnswer: 42", "42"),  # slime reads a \boxed answer only
        ("the result is 42", "42"),
        (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}"),  # an unreduced fraction is wrong (slime)
        ("", "42"),
    ],
)
def test_math_wrong_or_missing_answers_score_zero(response, label):
    assert _rm("math", response, label) == 0.0


def test_math_without_label_raises():
    with pytest.raises(ValueError, match="needs a label"):
        compute_math_reward(r"\boxed{1}", None)


# ---------------------------------------------------------------- gsm8k


def _gsm8k_path() -> Path:
    shared = os.environ.get("VIME_SHARED_DIR")
    root = Path(shared) if shared else Path(__file__).resolve().parents[2].parent / "shared"
    return root / "data" / "gsm8k_test.jsonl"


def test_gsm8k_real_data_reference_solutions_and_perturbations():
    path = _gsm8k_path()
    if not path.exists():
        pytest.skip(f"GSM8K test set not found: {path} (set VIME_SHARED_DIR)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(rows) > 1000
    for row in rows:
        solution = row["answer"]
        body, number = solution.rsplit("####", 1)
        value = parse_gsm8k_label(solution)
        assert compute_gsm8k_reward(solution, solution) == 1.0, solution
        assert compute_gsm8k_reward(f"{body}#### {value + 1}", solution) == 0.0, solution
        assert compute_gsm8k_reward(f"I think the answer is {value * 2 + 7}.", solution) == 0.0, solution
        # Free-form text ending in the number, with the bare number as label.
        assert compute_gsm8k_reward(f"So the total is ${number.strip()}.", number.strip()) == 1.0, solution


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so she makes $18 every day.", "18"),
        ("16 - 3 - 4 = 9 eggs.\n#### 9\nThe end: 100", "9"),
        (r"The final answer is $\boxed{\$1,234}$ and 7 more", "1,234"),
        ("The answer is: -5, not 3", "-5"),
        ("it costs $3.50.", "3.50"),
        ("from 16-3 we get", "3"),  # a dash glued to a number is subtraction, not a sign
        ("total: -12", "-12"),
        ("no digits here", None),
    ],
)
def test_gsm8k_final_number_extraction(text, expected):
    assert extract_final_number(text) == expected


@pytest.mark.parametrize(
    "response, label, reward",
    [
        ("so she makes $18 every day.", 18, 1.0),
        ("so she makes $18 every day.", "18", 1.0),
        ("so she makes $19 every day.", "18", 0.0),
        ("It costs $3.50.", "3.5", 1.0),
        ("The total is 1,234 apples.", "blah\n#### 1,234", 1.0),
        ("The total is 1234.", "1,234", 1.0),
        ("The change is -4 degrees", "-4", 1.0),
        ("The change is 4 degrees", "-4", 0.0),
        ("I don't know", "5", 0.0),
    ],
)
def test_gsm8k_reward(response, label, reward):
    assert _rm("gsm8k", response, label) == reward


def test_gsm8k_non_numeric_label_raises():
    with pytest.raises(ValueError, match="is not a number"):
        compute_gsm8k_reward("5", "five apples")


# ---------------------------------------------------------------- f1 and exact


def test_normalize_answer_squad_style():
    assert normalize_answer("  The Eiffel-Tower, in  PARIS! ") == "eiffeltower in paris"


@pytest.mark.parametrize(
    "prediction, truth, expected",
    [
        ("the cat sat", "a cat sat", 1.0),  # articles dropped
        ("cat sat on mat", "cat sat", 2 * (2 / 4) * 1.0 / (2 / 4 + 1.0)),  # p=1/2, r=1 → 2/3
        ("red blue", "blue green yellow", 2 * (1 / 2) * (1 / 3) / (1 / 2 + 1 / 3)),  # 0.4
        ("dog dog", "dog", 2 * (1 / 2) * 1.0 / (1 / 2 + 1.0)),  # common counts clip: 2/3
        ("nothing shared", "totally different", 0.0),
        ("", "cat", 0.0),
        ("The.", "a", 0.0),  # both normalise to empty: no shared token (slime)
        ("yes it is", "yes", 0.0),  # yes / no / noanswer are all or nothing (slime)
    ],
)
def test_f1_hand_computed(prediction, truth, expected):
    assert f1_score(prediction, truth) == pytest.approx(expected)


def test_f1_reward_via_async_rm_takes_best_of_list_label():
    assert _rm("f1", "Paris France", "paris") == pytest.approx(2 / 3)
    assert _rm("f1", "Paris France", ["london", "Paris, France"]) == pytest.approx(1.0)


def test_exact():
    assert _rm("exact", "  abc\n", "abc") == 1.0
    assert _rm("exact", "7", 7) == 1.0
    assert _rm("exact", "abcd", "abc") == 0.0


def test_unknown_rm_type_lists_valid_names():
    with pytest.raises(ValueError, match="unknown --rm-type 'nope'.*math, gsm8k, f1, exact, deepscaler"):
        _rm("nope", "x", "x")
    with pytest.raises(ValueError, match="unknown --rm-type 'boxed_remote_rm'"):
        _rm("boxed_remote_rm", "x", "x")
    with pytest.raises(ValueError, match="ifbench: slime clones allenai/IFBench"):
        _rm("ifbench", "x", "x")


# ---------------------------------------------------------------- remote_rm


async def _with_reward_server(body_fn):
    """Start a local aiohttp reward server, run ``body_fn(url, received)``, stop the server."""
    received = []

    async def handle(request):
        payload = await request.json()
        received.append(payload)
        mode = payload["label"]
        if mode == "fail":
            return web.Response(status=500, text="boom: " + "x" * 500)
        if mode == "number":
            return web.json_response(0.25)
        if mode == "dict":
            return web.json_response({"acc": 1.0, "len": 0.5})
        return web.json_response({"reward": 0.75, "extra": 1})

    app = web.Application()
    app.router.add_post("/rm", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        return await body_fn(f"http://127.0.0.1:{port}/rm", received)
    finally:
        await runner.cleanup()


def test_remote_rm_against_a_local_server():
    async def body(url, received):
        args = _args(rm_type="remote_rm", rm_url=url)
        sample = Sample(
            prompt=[{"role": "user", "content": "hi"}], response="r", label="ok", metadata={"k": 1}
        )
        rewards = await batched_async_rm(args, [sample, Sample(label="number"), Sample(label="dict")])
        with pytest.raises(RuntimeError, match=r"HTTP 500: boom: x+$") as info:
            await async_rm(args, Sample(label="fail"))
        return rewards, received, str(info.value)

    rewards, received, error = asyncio.run(_with_reward_server(body))
    assert rewards == [0.75, 0.25, {"acc": 1.0, "len": 0.5}]
    assert received[0] == {
        "prompt": [{"role": "user", "content": "hi"}],
        "response": "r",
        "label": "ok",
        "metadata": {"k": 1},
    }
    assert len(error.split("HTTP 500: ")[1]) == 200  # the body is cut to 200 chars


def test_remote_rm_failure_marks_sample_failed_through_reward_samples():
    async def body(url, received):
        samples = [Sample(label="ok"), Sample(label="fail")]
        failures = await reward_samples(_args(rm_type="remote_rm", rm_url=url), samples)
        return failures, samples

    failures, samples = asyncio.run(_with_reward_server(body))
    assert failures == 1
    assert samples[0].reward == 0.75 and samples[0].status == Status.PENDING
    assert samples[1].status == Status.FAILED and "HTTP 500" in samples[1].failure_reason


def test_remote_rm_without_url_raises():
    with pytest.raises(ValueError, match="needs --rm-url"):
        _rm("remote_rm", "x", "y")


# ---------------------------------------------------------------- reward_samples

# Custom reward functions, loaded through --custom-rm-path by this module's import name (which depends on
# how pytest imports it).
_THIS = __name__


async def raise_on_bad(args, sample, **kwargs):
    if sample.label == "bad":
        raise ValueError("label is bad")
    return 1.0


async def slow_on_slow(args, sample, **kwargs):
    if sample.label == "slow":
        await asyncio.sleep(5)
    return 0.5


async def raises_timeout_error_itself(args, sample, **kwargs):
    raise TimeoutError("upstream timed out")


async def returns_none(args, sample, **kwargs):
    return None


def sync_reward(args, sample, **kwargs):
    return 1.0


async def group_rank(args, samples, **kwargs):
    return [float(i) for i, _ in enumerate(samples)]


async def group_wrong_length(args, samples, **kwargs):
    return [1.0]


async def group_raises(args, samples, **kwargs):
    raise RuntimeError("judge down")


def _custom(name, **kwargs):
    return _args(custom_rm_path=f"{_THIS}.{name}", **kwargs)


def test_reward_samples_builtin_sets_rewards_and_skips_failed_generation():
    samples = [Sample(response="9", label="9"), Sample(response="8", label="9"), Sample(label="9")]
    samples[2].mark_failed("generation failed")
    failures = asyncio.run(reward_samples(_args(rm_type="exact"), samples))
    assert failures == 0
    assert [s.reward for s in samples] == [1.0, 0.0, None]
    assert samples[2].failure_reason == "generation failed"


def test_reward_samples_custom_raise_fails_only_that_sample():
    samples = [Sample(label="a"), Sample(label="bad"), Sample(label="c")]
    failures = asyncio.run(reward_samples(_custom("raise_on_bad"), samples))
    assert failures == 1
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]
    assert [s.status for s in samples] == [Status.PENDING, Status.FAILED, Status.PENDING]
    assert samples[1].failure_reason == "reward function raised ValueError: label is bad"


def test_reward_samples_timeout_fails_only_the_slow_sample():
    samples = [Sample(label="fast"), Sample(label="slow")]
    failures = asyncio.run(reward_samples(_custom("slow_on_slow", rm_timeout=0.2), samples))
    assert failures == 1
    assert samples[0].reward == 0.5 and samples[0].status == Status.PENDING
    assert samples[1].reward == 0.0 and samples[1].status == Status.FAILED
    assert samples[1].failure_reason == "reward timed out after 0.2s"


def test_reward_samples_timeout_error_from_the_function_is_reported_as_raised():
    samples = [Sample(label="x")]
    assert asyncio.run(reward_samples(_custom("raises_timeout_error_itself", rm_timeout=10), samples)) == 1
    assert samples[0].failure_reason == "reward function raised TimeoutError: upstream timed out"


def test_reward_samples_non_numeric_reward_fails_the_sample():
    samples = [Sample(label="x")]
    assert asyncio.run(reward_samples(_custom("returns_none"), samples)) == 1
    assert "returned NoneType" in samples[0].failure_reason


def test_reward_samples_sync_custom_function_is_a_config_error():
    with pytest.raises(TypeError, match="async def"):
        asyncio.run(reward_samples(_custom("sync_reward"), [Sample(label="x")]))


def test_reward_samples_group_rm_custom_called_once_with_non_failed_samples():
    samples = [Sample(label="a"), Sample(label="b"), Sample(label="c")]
    samples[1].mark_failed("generation failed")
    assert asyncio.run(reward_samples(_custom("group_rank", group_rm=True), samples)) == 0
    assert [s.reward for s in samples] == [0.0, None, 1.0]


def test_reward_samples_group_rm_builtin():
    samples = [Sample(response="1", label="1"), Sample(response="2", label="1")]
    assert asyncio.run(reward_samples(_args(rm_type="exact", group_rm=True), samples)) == 0
    assert [s.reward for s in samples] == [1.0, 0.0]


def test_reward_samples_group_rm_wrong_length_raises():
    samples = [Sample(label="a"), Sample(label="b")]
    with pytest.raises(ValueError, match="returned 1 rewards for 2 samples"):
        asyncio.run(reward_samples(_custom("group_wrong_length", group_rm=True), samples))


def test_reward_samples_group_rm_raise_fails_the_whole_group():
    samples = [Sample(label="a"), Sample(label="b")]
    assert asyncio.run(reward_samples(_custom("group_raises", group_rm=True), samples)) == 2
    assert all(s.status == Status.FAILED and s.reward == 0.0 for s in samples)
    assert samples[0].failure_reason == "reward function raised RuntimeError: judge down"


def test_reward_samples_bad_custom_path_names_module_and_attribute():
    with pytest.raises(ImportError, match="no_such_module.*--custom-rm-path"):
        asyncio.run(reward_samples(_args(custom_rm_path="no_such_module.fn"), [Sample()]))
    with pytest.raises(AttributeError, match="has no attribute 'missing_fn'.*--custom-rm-path"):
        asyncio.run(reward_samples(_custom("missing_fn"), [Sample()]))


def test_reward_samples_unknown_rm_type_is_a_config_error():
    samples = [Sample(response="x", label="x")]
    with pytest.raises(ValueError, match="unknown --rm-type 'nope'; valid: math, gsm8k, f1, exact"):
        asyncio.run(reward_samples(_args(rm_type="nope"), samples))
    assert samples[0].status == Status.PENDING


def test_rm_types_constant():
    assert rm_hub.RM_TYPES == (
        "math", "gsm8k", "f1", "exact", "deepscaler", "dapo", "gpqa", "random", "remote_rm"
    )  # fmt: skip


def test_math_works_off_the_main_thread():
    # the rule-based rewards run on a Ray actor's event-loop thread: nothing may need the main thread (signals)
    reward = asyncio.run(asyncio.to_thread(compute_math_reward, r"\boxed{0.5}", r"\frac{1}{2}"))
    assert reward == 1.0


def test_every_rm_type_name_is_implemented():
    # the names live in vime.utils.rm_types (checked at parse time); rm_hub implements each of them
    assert set(rm_hub._RULE_BASED) | {"remote_rm"} == set(rm_hub.RM_TYPES)
