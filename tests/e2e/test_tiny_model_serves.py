"""The tiny model serves in a real vLLM server: token-in/token-out with log-probs, both eos ids stop, the
server's chat template matches the tokenizer's, its engine core is forked (vime's CPU server), and stopping the server leaves no process behind."""

from __future__ import annotations

import psutil
import pytest
import requests

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _complete(url: str, model: str, prompt_ids: list[int], **extra) -> dict:
    body = {"model": model, "prompt": prompt_ids, "max_tokens": 4, "return_token_ids": True, "logprobs": 0}
    resp = requests.post(f"{url}/v1/completions", json={**body, "temperature": 1.0, **extra}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_tiny_model_serves_tokens_and_logprobs(tiny_model_dir, engine_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = engine_factory(tiny_model_dir)
    print(f"vLLM engine ready in {engine.ready_s:.1f}s")
    model = str(tiny_model_dir)
    prompt_ids = tok.encode("17+3=")

    choice = _complete(engine.url, model, prompt_ids)
    assert choice["finish_reason"] in {"stop", "length"}
    token_ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert 1 <= len(token_ids) <= 4 and len(token_ids) == len(logprobs)
    assert all(isinstance(t, int) and 0 <= t < len(tok) for t in token_ids)
    assert all(isinstance(lp, float) and lp <= 0.0 for lp in logprobs)
    assert choice["prompt_token_ids"] == prompt_ids

    # Both eos ids end a response (tokenizer eos <|im_end|>, plus generation_config's <|endoftext|>), and
    # the stop token is part of token_ids.
    for eos in (tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id):
        forced = _complete(engine.url, model, prompt_ids, logit_bias={str(eos): 100})
        assert forced["finish_reason"] == "stop" and forced["token_ids"] == [eos], forced

    # The server renders chats with the tokenizer's own template.
    messages = [{"role": "user", "content": "17+3="}]
    body = {"model": model, "messages": messages, "max_tokens": 2, "return_token_ids": True}
    chat = requests.post(f"{engine.url}/v1/chat/completions", json=body, timeout=60)
    assert chat.status_code == 200, chat.text
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.json()["prompt_token_ids"] == tok.encode(expected)

    children = psutil.Process(engine.proc.pid).children(recursive=True)
    assert children, "expected vLLM's engine-core process under the API server"
    # on CPU the engine core is forked from the server (vime.backends.vllm_utils.cpu_server): a spawning server also
    # starts multiprocessing's resource tracker, and its core imports vLLM a second time
    (server,) = [c for c in children if "vime.backends.vllm_utils.cpu_server" in c.cmdline()]
    assert [c.name() for c in server.children()] == ["VLLM::EngineCore"], [
        c.cmdline() for c in server.children()
    ]
    engine.stop()
    assert engine.proc.returncode is not None
    assert engine.live_processes() == []
    for child in children:
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, child
