"""On-policy distillation: slime's --use-opd / --opd-type at parse time, and the teacher-server reward and
post-process of vime.rollout.on_policy_distillation (the trainer side is in test_fsdp_trainer.py)."""

from __future__ import annotations

import asyncio
import contextlib
import io

import pytest
from aiohttp import web

from vime.rollout import on_policy_distillation as opd
from vime.utils import http_utils
from vime.utils.arguments import parse_args
from vime.utils.misc import free_port
from vime.utils.types import Sample, Status

BASE = ["--train-backend", "fsdp", "--hf-checkpoint", "m", "--prompt-data", "p.jsonl",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1"]  # fmt: skip


def _error_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()):
        parse_args(argv)
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--use-opd"], "--use-opd needs --opd-type: vllm"),
        (["--use-opd", "--opd-type", "trainer"], "--opd-type trainer needs --opd-teacher-load"),
        (["--opd-teacher-load", "t"], "--opd-teacher-load is set but --use-opd is not"),
        (["--opd-type", "vllm"], "--opd-type is set but --use-opd is not"),
        (["--use-opd", "--opd-type", "sglang", "--opd-teacher-load", "t"], "drop --opd-teacher-load"),
        (
            ["--use-opd", "--opd-type", "vllm", "--rollout-temperature", "0.7"],
            "vLLM returns prompt log-probs of the unscaled logits",
        ),
        (["--use-opd", "--opd-type", "nope"], "argument --opd-type: invalid choice"),
        (
            ["--use-opd", "--opd-type", "vllm", "--loss-type", "sft_loss"],
            "--use-opd would not take effect",
        ),
    ],
)
def test_opd_flags_are_checked_as_slime_does(extra, expected, capsys):
    assert expected in _error_of(BASE + extra, capsys)


@pytest.mark.parametrize(("given", "kind"), [("sglang", "vllm"), ("vllm", "vllm"), ("megatron", "trainer")])
def test_slimes_opd_type_names_map_to_vimes(given, kind):
    teacher = ["--opd-teacher-load", "t"] if kind == "trainer" else []
    args = parse_args(BASE + ["--use-opd", "--opd-type", given, *teacher])
    assert args.use_opd and args.opd_type == kind and args.opd_kl_coef == 1.0  # slime's default coefficient


def test_no_opd_by_default():
    args = parse_args(BASE)
    assert not args.use_opd and args.opd_type is None


@pytest.mark.parametrize(
    ("rm_url", "expected"),
    [
        ("http://t:8000", "http://t:8000/v1/completions"),
        ("http://t:8000/", "http://t:8000/v1/completions"),
        ("http://t:8000/generate", "http://t:8000/v1/completions"),  # a slime script's SGLang URL
        ("http://t:8000/v1/completions", "http://t:8000/v1/completions"),
        ("https://gw/teacher", "https://gw/teacher/v1/completions"),
    ],
)
def test_teacher_url_from_rm_url(rm_url, expected):
    assert opd.teacher_completions_url(rm_url) == expected


@pytest.mark.parametrize(("rm_url", "match"), [(None, "needs --rm-url"), ("t:8000", "expected http://")])
def test_teacher_url_errors(rm_url, match):
    with pytest.raises(ValueError, match=match):
        opd.teacher_completions_url(rm_url)


def _prompt_logprobs(tokens, values):
    return [None] + [{str(t): {"logprob": v, "rank": 1}} for t, v in zip(tokens[1:], values, strict=True)]


def test_response_log_probs_are_the_last_response_length_entries():
    tokens = [7, 8, 9, 10, 11]
    choice = {"prompt_logprobs": _prompt_logprobs(tokens, [-0.1, -0.2, -0.3, -0.4])}
    assert opd.response_log_probs(choice, tokens, 2) == [-0.3, -0.4]
    assert opd.response_log_probs(choice, tokens, 4) == [-0.1, -0.2, -0.3, -0.4]
    with pytest.raises(ValueError, match="at least one prompt token"):
        opd.response_log_probs(choice, tokens, 5)
    with pytest.raises(ValueError, match="3 prompt log-probs for 5 tokens"):
        opd.response_log_probs({"prompt_logprobs": [None, {}, {}]}, tokens, 2)
    wrong = {"prompt_logprobs": _prompt_logprobs([7, 8, 9, 10, 99], [-0.1, -0.2, -0.3, -0.4])}
    with pytest.raises(
        ValueError, match="do not cover token 11: does the teacher use the student's tokenizer"
    ):
        opd.response_log_probs(wrong, tokens, 2)


def test_reward_func_asks_the_teacher_and_stores_response_log_probs():
    seen = []

    async def completions(request):
        body = await request.json()
        seen.append(body)
        tokens = body["prompt"]
        values = [-(i + 1) / 10 for i in range(len(tokens) - 1)]
        return web.json_response({"choices": [{"prompt_logprobs": _prompt_logprobs(tokens, values)}]})

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            args = parse_args(BASE + ["--rm-url", f"http://127.0.0.1:{port}/generate"])
            sample = Sample(index=0, tokens=[5, 6, 7, 8], response_length=2, status=Status.COMPLETED)
            return await opd.reward_func(args, sample), sample
        finally:
            await runner.cleanup()
            await http_utils._session().close()

    reward, sample = asyncio.run(main())
    assert reward == 0.0 and sample.teacher_log_probs == [-0.2, -0.3]
    assert seen == [{"prompt": [5, 6, 7, 8], "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}]


def test_post_process_checks_teacher_log_probs_and_zeroes_rewards():
    good = Sample(index=0, tokens=[1, 2, 3], response_length=2, reward=0.0, teacher_log_probs=[-1.0, -2.0])
    failed = Sample(
        index=1, tokens=[1, 2], response_length=1, status=Status.FAILED
    )  # its teacher call failed
    assert opd.post_process_rewards(None, [good, failed]) == ([0.0, 0.0], [0.0, 0.0])
    short = Sample(index=2, tokens=[1, 2, 3], response_length=2, teacher_log_probs=[-1.0])
    with pytest.raises(ValueError, match="sample 2: 1 teacher log-probs for 2 response tokens"):
        opd.post_process_rewards(None, [short])
    with pytest.raises(ValueError, match="sample 3: none teacher log-probs"):
        opd.post_process_rewards(None, [Sample(index=3, tokens=[1, 2], response_length=1)])
