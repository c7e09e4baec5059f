"""vime.rollout.sglang_compat: SGLang /generate payloads as vLLM completion requests and back, against a fake
vLLM server (the real engine is in tests/e2e/test_examples.py)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from vime.rollout import sglang_compat
from vime.utils import http_utils
from vime.utils.misc import free_port


def test_sglang_sampling_params_map_to_vllm_fields():
    fields = sglang_compat.vllm_sampling_fields(
        {"max_new_tokens": 16, "min_new_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
         "stop": ["</search>"], "stop_token_ids": [2], "no_stop_trim": False, "sampling_seed": 3,
         "regex": "a+", "json_schema": '{"type": "object"}', "skip_special_tokens": False}
    )  # fmt: skip
    assert fields == {
        "max_tokens": 16, "min_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop": ["</search>"],
        "stop_token_ids": [2], "include_stop_str_in_output": False, "seed": 3, "skip_special_tokens": False,
        "structured_outputs": {"regex": "a+", "json": {"type": "object"}},
    }  # fmt: skip


def test_defaults_and_vllm_names_from_vimes_sampling_params():
    assert sglang_compat.vllm_sampling_fields({}) == {"max_tokens": 128, "include_stop_str_in_output": True}
    # vime hands generate functions vLLM names; a plug-in that also sets SGLang's max_new_tokens wins
    fields = sglang_compat.vllm_sampling_fields({"max_tokens": 1024, "max_new_tokens": 10, "top_k": -1})
    assert fields == {"max_tokens": 10, "top_k": -1, "include_stop_str_in_output": True}
    with pytest.raises(
        ValueError, match=r"SGLang sampling_params \['custom_params'\] have no vLLM equivalent"
    ):
        sglang_compat.vllm_sampling_fields({"custom_params": {}})


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ({"input_ids": [1], "image_data": ["x"]}, r"fields \['image_data'\] are not supported"),
        ({"input_ids": [1], "stream": True}, "stream=true"),
        ({"sampling_params": {}}, "exactly one of input_ids and text"),
        ({"input_ids": [1], "text": "a"}, "exactly one of input_ids and text"),
        ({"input_ids": [[1, 2], [3]]}, "batches are refused"),
        ({"input_ids": []}, "batches are refused"),
    ],
)
def test_unsupported_payloads_are_refused(payload, match):
    with pytest.raises(ValueError, match=match):
        sglang_compat.vllm_request(payload)


def test_score_only_request_asks_for_one_token_and_prompt_log_probs():
    request, score_only = sglang_compat.vllm_request(
        {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
         "logprob_start_len": 0}
    )  # fmt: skip
    assert score_only and request["max_tokens"] == 1 and request["prompt_logprobs"] == 0
    assert request["prompt"] == [4, 5, 6] and request["logprobs"] == 0 and request["return_token_ids"]
    request, _ = sglang_compat.vllm_request({"text": "hi", "return_logprob": True})
    assert "prompt_logprobs" not in request and request["prompt"] == "hi"  # SGLang's default: output only


def _choice(**kw):
    return {"text": "ab", "token_ids": [10, 11], "prompt_token_ids": [4, 5, 6], "finish_reason": "stop",
            "stop_reason": "b", "logprobs": {"token_logprobs": [-0.5, -0.25]}, **kw}  # fmt: skip


def test_vllm_choice_in_sglangs_shape():
    out = sglang_compat.sglang_output(
        {"id": "c1"}, _choice(), {"input_ids": [4, 5, 6], "return_logprob": True}, False
    )
    assert out == {
        "text": "ab",
        "output_ids": [10, 11],
        "meta_info": {
            "id": "c1", "finish_reason": {"type": "stop", "matched": "b"}, "prompt_tokens": 3,
            "completion_tokens": 2, "output_token_logprobs": [[-0.5, 10, None], [-0.25, 11, None]],
        },
    }  # fmt: skip
    prompt_logprobs = [None, {"5": {"logprob": -1.0}}, {"6": {"logprob": -2.0}}]
    scored = sglang_compat.sglang_output(
        {"id": "c2"},
        _choice(prompt_logprobs=prompt_logprobs, finish_reason="length", stop_reason=None),
        {"input_ids": [4, 5, 6], "return_logprob": True, "logprob_start_len": 0},
        True,
    )
    assert (
        scored["text"] == ""
        and scored["output_ids"] == []
        and scored["meta_info"]["finish_reason"] == {"type": "length"}
    )
    assert scored["meta_info"]["input_token_logprobs"] == [[None, 4, None], [-1.0, 5, None], [-2.0, 6, None]]
    assert scored["meta_info"]["output_token_logprobs"] == []


def test_post_sends_generate_to_the_hosts_completions_and_other_urls_unchanged():
    seen = []

    async def completions(request):
        body = await request.json()
        seen.append(("completions", body))
        n = body.get("n", 1)
        return web.json_response({"id": "x", "choices": [_choice(index=i) for i in range(n)]})

    async def other(request):
        seen.append(("other", await request.json()))
        return web.json_response({"ok": True})

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/other", other)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        base = f"http://127.0.0.1:{port}"
        try:
            one = await sglang_compat.post(
                f"{base}/generate", {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 2}}
            )
            two = await sglang_compat.post(f"{base}/generate", {"text": "q", "sampling_params": {"n": 2}})
            plain = await sglang_compat.post(f"{base}/other", {"a": 1})
            return one, two, plain
        finally:
            await runner.cleanup()
            await http_utils._session().close()

    one, two, plain = asyncio.run(main())
    assert (
        one["text"] == "ab"
        and one["output_ids"] == [10, 11]
        and "output_token_logprobs" not in one["meta_info"]
    )
    assert isinstance(two, list) and len(two) == 2  # n > 1: one answer per choice, as SGLang
    assert plain == {"ok": True}
    assert seen[0] == (
        "completions",
        {"max_tokens": 2, "include_stop_str_in_output": True, "prompt": [4, 5, 6], "return_token_ids": True,
         "return_tokens_as_token_ids": True},
    )  # fmt: skip
    assert seen[2] == ("other", {"a": 1})
