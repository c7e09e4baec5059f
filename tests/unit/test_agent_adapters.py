"""vime.agent (slime's ``slime.agent`` adapters, issue 26 item 1): an OpenAI and an Anthropic client drive sessions
through the adapters, served on their own thread, against a fake vLLM server; each session becomes training samples
with the engine's tokens, a loss mask and log-probs."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from fake_http import serve_posts

from vime.agent.adapters import AnthropicAdapter, OpenAIAdapter, common
from vime.agent.adapters.anthropic import fold_late_system_messages
from vime.agent.adapters.common import flatten_content
from vime.agent.aiohttp_threaded import FilteredAccessLogger, run_app_in_thread
from vime.rollout.generate_state import load_tokenizer
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils.http_utils import close_session
from vime.utils.sglang_compat import SamplingParams
from vime.utils.types import Sample, Status

REPLIES: list[str] = []
REQUESTS: list[dict] = []


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(str(build_tiny_model(tmp_path_factory.mktemp("agent") / "m", seed=0, task=None)))


class FakeToolParser:
    """Stands in for a vLLM tool parser (the tiny tokenizer has no braces for JSON): ``call name`` is a call."""

    def __init__(self, tokenizer):
        pass

    def adjust_request(self, request):
        return request

    def extract_tool_calls(self, text, request):
        if not text.startswith("call "):
            return SimpleNamespace(tools_called=False, tool_calls=[], content=text)
        function = SimpleNamespace(name=text.split()[1], arguments=json.dumps({"x": 1}))
        return SimpleNamespace(
            tools_called=True, tool_calls=[SimpleNamespace(function=function)], content=None
        )


async def _fake_vllm(tokenizer):
    async def completions(request):
        body = await request.json()
        REQUESTS.append(body)
        ids = tokenizer(REPLIES.pop(0), add_special_tokens=False)["input_ids"]
        choice = {"index": 0, "text": "", "token_ids": ids, "prompt_token_ids": body["prompt"], "finish_reason": "stop",
                  "stop_reason": None, "logprobs": {"token_logprobs": [-0.1] * len(ids)}}  # fmt: skip
        return web.json_response({"id": "c", "choices": [choice]})

    return await serve_posts({"/v1/completions": completions})


def _run_sessions(tokenizer, adapter_cls, client):
    async def main():
        runner, engine_url = await _fake_vllm(tokenizer)
        adapter = adapter_cls(
            tokenizer=tokenizer, sglang_url=engine_url, tool_parser="fake", max_turns_per_sid=3
        )
        handle = run_app_in_thread(
            adapter.app, host="127.0.0.1", runner_kwargs={"access_log_class": FilteredAccessLogger}
        )
        adapter.open_session("s1", sampling_defaults=SamplingParams(max_tokens=9, temperature=1.0))
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{handle.port}") as http:
                answers = await client(http)
            samples = await adapter.finish_session(
                "s1", base_sample=Sample(index=5, prompt="p", label="l"), reward=1.0, extra_metadata={"k": 1}
            )
            async with aiohttp.ClientSession(f"http://127.0.0.1:{handle.port}") as http:
                async with http.post(adapter_path(adapter_cls), json={}, headers=_sid("s1")) as late:
                    answers.append(late.status)
            return answers, samples
        finally:
            handle.stop()
            await close_session()
            await runner.cleanup()

    return asyncio.run(main())


def adapter_path(adapter_cls):
    return "/v1/chat/completions" if adapter_cls is OpenAIAdapter else "/v1/messages"


def _sid(sid):
    return {"Authorization": f"Bearer {sid}"}


def _check_samples(tokenizer, samples):
    """Turn 1 answered plainly, turn 2 (the echo + a new user message) extends it, turn 3 (a sub-agent's own
    history) does not: two samples of one trajectory."""
    assert len(samples) == 2 and all(s.rollout_id == 5 and s.reward == 1.0 for s in samples)
    first, second = samples
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    prompt = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    hello, more = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("hello", "more"))
    assert (
        first.tokens[: len(prompt)] == prompt
        and first.tokens[len(prompt) : len(prompt) + len(hello)] == hello
    )
    assert first.response_length == len(first.tokens) - len(prompt) == len(first.loss_mask)
    assert first.loss_mask[: len(hello)] == [1] * len(hello) and first.loss_mask[-len(more) :] == [1] * len(
        more
    )
    assert (
        sum(first.loss_mask) == len(hello) + len(more) and 0 in first.loss_mask
    )  # the new user turn: mask 0
    assert first.rollout_log_probs == [-0.1 if m else 0.0 for m in first.loss_mask]
    assert (
        first.response.startswith("hello") and first.metadata == {"k": 1} and first.status == Status.COMPLETED
    )
    assert second.loss_mask == [1] * len(tokenizer("call f", add_special_tokens=False)["input_ids"])
    assert first.prompt == "p" and first.label == "l" and first.index == 5


def test_openai_adapter_turns_a_session_into_samples(tokenizer, monkeypatch):
    monkeypatch.setattr(common, "tool_parser_class", lambda name: FakeToolParser)
    REPLIES[:] = ["hello", "more", "call f"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

    async def client(http):
        history = [{"role": "user", "content": "hi"}]
        out = []
        for extra, stream in (([], False), ([{"role": "user", "content": "again"}], False), ([], True)):
            body = {
                "model": "m",
                "messages": history + extra
                if not stream
                else [{"role": "user", "content": "sub"}],  # a sub-agent
                "tools": tools,
                "max_tokens": 5,
                "stream": stream,
            }
            async with http.post("/v1/chat/completions", json=body, headers=_sid("s1")) as response:
                out.append(await response.json() if not stream else await response.text())
            if not stream:
                history = history + extra + [out[-1]["choices"][0]["message"]]
        return out

    answers, samples = _run_sessions(tokenizer, OpenAIAdapter, client)
    first, second, streamed, late = answers
    assert first["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "hello"},
        "finish_reason": "stop",
    }
    assert second["choices"][0]["message"]["content"] == "more"
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    call = chunks[1]["choices"][0]["delta"]["tool_calls"][0]
    assert call["function"] == {"name": "f", "arguments": '{"x": 1}'} and call["index"] == 0
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" and streamed.endswith("data: [DONE]\n\n")
    assert late == 503  # the session is over
    assert all(
        r["max_tokens"] == 5 and r["temperature"] == 1.0 for r in REQUESTS[-3:]
    )  # the client's cap applies
    _check_samples(tokenizer, samples)


def test_anthropic_adapter_turns_a_session_into_samples(tokenizer, monkeypatch):
    monkeypatch.setattr(common, "tool_parser_class", lambda name: FakeToolParser)
    REPLIES[:] = ["hello", "more", "call f"]
    tools = [{"name": "f", "description": "", "input_schema": {"type": "object"}}]

    async def client(http):
        history = [{"role": "user", "content": "hi"}]
        out = []
        for extra, stream in (([], False), ([{"role": "user", "content": "again"}], False), ([], True)):
            body = {
                "model": "m",
                "messages": history + extra
                if not stream
                else [{"role": "user", "content": "sub"}],  # a sub-agent
                "tools": tools,
                "max_tokens": 5,
                "stream": stream,
            }
            async with http.post("/v1/messages", json=body, headers={"X-Api-Key": "s1"}) as response:
                out.append(await response.json() if not stream else await response.text())
            if not stream:
                history = history + extra + [{"role": "assistant", "content": out[-1]["content"]}]
        async with http.post("/v1/messages/count_tokens", json={"messages": history}) as response:
            out.append((await response.json())["input_tokens"])
        return out

    answers, samples = _run_sessions(tokenizer, AnthropicAdapter, client)
    first, second, streamed, counted, late = answers
    assert first["content"] == [{"type": "text", "text": "hello"}] and first["stop_reason"] == "end_turn"
    assert second["content"][0]["text"] == "more" and counted > 0
    events = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events][:2] == ["message_start", "content_block_start"]
    assert events[1]["content_block"]["name"] == "f" and events[2]["delta"]["partial_json"] == '{"x": 1}'
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-1]["type"] == "message_stop"
    assert late == 503
    _check_samples(tokenizer, samples)


def test_turn_cap_and_content_helpers():
    assert flatten_content([{"type": "text", "text": "a"}, {"type": "tool_result", "content": [{"type": "text", "text": "b"}]},
                            {"type": "image"}, "c"]) == "a\nb\n[image omitted]\nc"  # fmt: skip
    assert flatten_content(None) == "" and flatten_content({"x": 1}) == "{'x': 1}"
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                         {"role": "system", "content": "late"}]}  # fmt: skip
    assert fold_late_system_messages(body) and len(body["messages"]) == 2
    assert body["messages"][1]["content"][-1]["text"] == "<system-reminder>\nlate\n</system-reminder>\n"
    adapter = OpenAIAdapter(tokenizer=None, sglang_url="http://x/")
    adapter.open_session("a")
    with pytest.raises(ValueError, match="already exists"):
        adapter.open_session("a")
