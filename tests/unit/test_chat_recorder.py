"""ChatRecorder: the conversation is rendered around the exact generated tokens and recorded as one sample (the
engine is replaced by a scripted generate here; tests/e2e/test_examples.py runs it against vLLM, with tool calls)."""

from __future__ import annotations

import asyncio

import pytest

from vime.rollout import chat_recorder
from vime.rollout.chat_recorder import ChatRecorder, ChatRequestError, GenerationStopped
from vime.rollout.generate_state import load_tokenizer
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils.arguments import parse_args
from vime.utils.types import Sample, Status


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("chat") / "m", seed=0, task=None)
    return parse_args(
        ["--train-backend", "fsdp", "--hf-checkpoint", str(model), "--prompt-data", "p.jsonl",
         "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--num-rollout", "1",
         "--rollout-max-response-len", "8"]
    )  # fmt: skip


@pytest.fixture(scope="module")
def tok(args):
    return load_tokenizer(args.hf_checkpoint)


@pytest.fixture
def ids(tok):
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def scripted(monkeypatch, tok):
    """Replace the engine: each generate call appends the next scripted (tokens, status)."""
    script: list[tuple[list[int], Status]] = []
    calls: list[dict] = []

    async def fake_generate(args, sample, params):
        calls.append({"tokens": list(sample.tokens), **params})
        tokens, status = script.pop(0)
        assert params["max_tokens"] - sample.response_length <= args.rollout_max_response_len
        sample.append_response_tokens(
            tokens=tokens, log_probs=[-0.5] * len(tokens), text=tok.decode(tokens, skip_special_tokens=True)
        )
        sample.status = status
        return sample

    monkeypatch.setattr(chat_recorder, "generate", fake_generate)
    return script, calls


def test_two_turns_record_prompt_replies_and_masked_template_tokens(args, scripted, tok, ids):
    script, calls = scripted
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    first, second = ids("ab") + [im_end], ids("7")
    script += [(first, Status.COMPLETED), (second, Status.TRUNCATED)]
    sample = Sample(index=0, prompt="q", tokens=[9, 9])  # the data source's prompt tokens are replaced
    recorder = ChatRecorder(args, sample, {"temperature": 1.0, "max_tokens": 8})
    messages = [{"role": "user", "content": "2+5?"}]
    reply = asyncio.run(recorder.chat(messages))
    prompt = ids("<|im_start|>user\n2+5?<|im_end|>\n<|im_start|>assistant\n")
    assert calls[0]["tokens"] == prompt and calls[0]["max_tokens"] == 8
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == 3
    # the agent may return the reply in another form: the recorded tokens, not the text, are the history
    messages += [{"role": "assistant", "content": "whatever"}, {"role": "tool", "content": "7"}]
    reply = asyncio.run(recorder.chat(messages, max_tokens=4, logprobs=True))
    between = ids("\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n")  # <|im_end|> was generated
    assert calls[1]["tokens"] == prompt + first + between and calls[1]["max_tokens"] == 3 + len(between) + 4
    assert sample.tokens == prompt + first + between + second
    assert sample.loss_mask == [1] * 3 + [0] * len(between) + [1]
    assert sample.rollout_log_probs == [-0.5] * 3 + [0.0] * len(between) + [-0.5]
    assert sample.response_length == len(sample.tokens) - len(prompt) and sample.status == Status.TRUNCATED
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "7"
    assert choice["logprobs"]["content"] == [
        {"token": f"token_id:{second[0]}", "logprob": -0.5, "bytes": None, "top_logprobs": []}
    ]


def test_requests_that_do_not_extend_the_trajectory_are_refused(args, scripted, ids):
    script, _ = scripted
    script += [(ids("ab"), Status.COMPLETED)]
    recorder = ChatRecorder(args, Sample(index=0), {"max_tokens": 8})
    messages = [{"role": "user", "content": "hi"}]
    asyncio.run(recorder.chat(messages))
    with pytest.raises(ChatRequestError, match="holds 0 assistant messages but this trajectory generated 1"):
        asyncio.run(recorder.chat(messages + [{"role": "user", "content": "more"}]))
    edited = [{"role": "user", "content": "HI"}, {"role": "assistant", "content": "ab"}]
    with pytest.raises(ChatRequestError, match="no longer starts with this trajectory's tokens"):
        asyncio.run(recorder.chat(edited + [{"role": "user", "content": "more"}]))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"n": 2}, "n=2: one reply per request"),
        ({"stream": True}, "stream=true"),
        ({"logprobs": True, "top_logprobs": 5}, "top_logprobs is not supported"),
        ({"logit_bias": {}}, r"unsupported chat request fields \['logit_bias'\]"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "no tool-call parser is set"),
    ],
)
def test_bad_requests_name_the_field(args, scripted, fields, match):
    recorder = ChatRecorder(args, Sample(index=0), {"max_tokens": 8})
    with pytest.raises(ChatRequestError, match=match):
        asyncio.run(recorder.chat([{"role": "user", "content": "hi"}], **fields))


def test_aborted_generation_stops_the_agent_and_rollout_sampling_wins(args, scripted, caplog):
    script, calls = scripted
    script += [([], Status.ABORTED)]
    recorder = ChatRecorder(args, Sample(index=3), {"temperature": 1.0, "max_tokens": 8})
    with pytest.raises(GenerationStopped, match="sample 3 aborted"):
        asyncio.run(recorder.chat([{"role": "user", "content": "hi"}], temperature=0.2, max_tokens=50))
    assert (
        calls[0]["temperature"] == 1.0 and calls[0]["max_tokens"] == 8
    )  # capped by --rollout-max-response-len
    assert "chat request temperature=0.2 ignored" in caplog.text
    with pytest.raises(ChatRequestError, match="partial rollout is not supported"):
        ChatRecorder(args, Sample(index=4, tokens=[1, 2], response_length=1), {})
