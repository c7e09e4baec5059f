"""vime's engine launcher, control client and router glue against a real vLLM server and vllm-router; the tiny
model's token-in/token-out, stop tokens and chat template in that server.

One engine and one router are shared by the module (2 CPU cores); the last test stops them and checks that
no process is left, so keep it last.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import aiohttp
import psutil
import pytest
import requests

from vime.backends.vllm_utils import fork_server
from vime.backends.vllm_utils.control_client import EngineControlClient, EngineControlError
from vime.backends.vllm_utils.engine import EngineStartError
from vime.backends.vllm_utils.router import (
    RouterProcess,
    connect_router,
    list_workers,
    register_workers,
    unregister_worker,
)
from vime.tools.make_tiny_model import build_tiny_model

pytestmark = pytest.mark.e2e

PROMPT = [5, 6, 7]
# The module's model takes long requests, so a pause lands mid-flight even on 2 busy cores, where the server's
# answers (its /metrics, the pause itself) can lag the engine by seconds.
CONTEXT = 8192
LONG = CONTEXT - 16  # max_tokens of a long request: ~12 s of decoding at n=4
KEPT = 2048  # max_tokens of the request a pause(keep) freezes: it then decodes to the end (a quarter of LONG's cost)


@pytest.fixture(scope="module")
def served(tmp_path_factory, module_engine_factory, module_router_factory) -> SimpleNamespace:
    """One tiny-model engine (seed 0, context ``CONTEXT``) registered with one router."""
    model = build_tiny_model(
        tmp_path_factory.mktemp("long") / "model", task=None, max_position_embeddings=CONTEXT
    )
    engine = module_engine_factory(model, "--vllm-max-model-len", str(CONTEXT))
    router = module_router_factory()
    asyncio.run(register_workers(router.url, [engine.url]))
    return SimpleNamespace(engine=engine, router=router, model=str(model))


def _body(served: SimpleNamespace, **extra) -> dict:
    return {
        "model": served.model,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 1.0,
        "return_token_ids": True,
        "logprobs": 0,
        **extra,
    }


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def _running_at_least(
    session: aiohttp.ClientSession, engine_url: str, n: int, request: asyncio.Task
) -> float:
    """Poll the engine's ``vllm:num_requests_running`` until it reaches ``n`` (or ``request`` ends; 10 s at most);
    the last count seen."""
    running = 0.0
    for _ in range(200):
        if request.done():
            return running
        async with session.get(f"{engine_url}/metrics") as resp:
            text = await resp.text()
        running = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:num_requests_running")
        )
        if running >= n:
            return running
        await asyncio.sleep(0.05)
    return running


def _finished_before_pause(request: asyncio.Task, max_tokens: int) -> bool:
    if not request.done():
        return False
    status, result = request.result()
    return status == 200 and all(
        c["finish_reason"] == "length" and len(c["token_ids"]) == max_tokens for c in result["choices"]
    )


async def _pause_mid_flight(
    session: aiohttp.ClientSession,
    client: EngineControlClient,
    served: SimpleNamespace,
    mode: str,
    max_tokens: int = LONG,
) -> asyncio.Task:
    """Send a long request (n=4, ``max_tokens`` each) through the router; once the engine runs its 4 samples,
    pause the engine with ``mode`` and return the request.

    Retried (5 tries) when the pause missed the request: it finished first, or with ``abort`` it had not reached
    the engine yet and is held until resume (not aborted; see the abort test)."""
    body = _body(served, n=4, max_tokens=max_tokens, ignore_eos=True)
    missed = []
    for _ in range(5):
        started = time.monotonic()
        request = asyncio.create_task(_post(session, served.router.url, body))
        running = await _running_at_least(session, served.engine.url, 4, request)
        seen = f"{running:.0f} running after {time.monotonic() - started:.1f} s"
        if request.done():
            missed.append(f"finished before the pause ({seen})")
        else:
            await client.pause(mode)
            await asyncio.wait([request], timeout=1.0 if mode == "keep" else 5.0)
            if not _finished_before_pause(request, max_tokens) and (mode == "keep" or request.done()):
                return request
            missed.append(f"{'finished before' if request.done() else 'not ended by'} the pause ({seen})")
            await client.resume()
        await request
    raise AssertionError(f"5 long requests all missed the pause(mode={mode}): {missed}")


def _tokens_and_logprobs(choice: dict) -> tuple[list[int], list[float]]:
    token_ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert len(token_ids) == len(logprobs), choice
    assert all(isinstance(lp, float) and lp <= 0.0 for lp in logprobs), choice
    return token_ids, logprobs


@pytest.mark.timeout(360)  # includes starting the module's engine
def test_generate_through_router_and_manage_workers(served):
    engine, router = served.engine, served.router
    assert asyncio.run(list_workers(router.url)) == [engine.url]
    asyncio.run(register_workers(router.url, [engine.url]))  # already listed: skipped, not an error
    assert asyncio.run(list_workers(router.url)) == [engine.url]

    resp = requests.post(f"{router.url}/v1/completions", json=_body(served, n=4), timeout=60)
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert len(choices) == 4
    for choice in choices:
        token_ids, _ = _tokens_and_logprobs(choice)
        assert 1 <= len(token_ids) <= 8 and choice["finish_reason"] in {"stop", "length"}
        assert choice["prompt_token_ids"] == PROMPT

    asyncio.run(unregister_worker(router.url, engine.url))
    assert asyncio.run(list_workers(router.url)) == []
    no_worker = requests.post(f"{router.url}/v1/completions", json=_body(served), timeout=60)
    assert no_worker.status_code == 503, no_worker.text
    asyncio.run(register_workers(router.url, [engine.url]))
    assert asyncio.run(list_workers(router.url)) == [engine.url]


def _complete(url: str, model: str, prompt_ids: list[int], **extra) -> dict:
    body = {"model": model, "prompt": prompt_ids, "max_tokens": 4, "return_token_ids": True, "logprobs": 0}
    resp = requests.post(f"{url}/v1/completions", json={**body, "temperature": 1.0, **extra}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


@pytest.mark.timeout(120)
def test_tiny_model_serves_tokens_and_logprobs_and_its_chat_template(served):
    """The tiny model in the real server: token-in/token-out with log-probs, both eos ids stop, the server's chat
    template is the tokenizer's, and its engine core is forked (vime's CPU server)."""
    from transformers import AutoTokenizer

    engine, model = served.engine, served.model
    tok = AutoTokenizer.from_pretrained(model)
    prompt_ids = tok.encode("17+3=")

    choice = _complete(engine.url, model, prompt_ids)
    assert choice["finish_reason"] in {"stop", "length"}
    token_ids, logprobs = _tokens_and_logprobs(choice)
    assert 1 <= len(token_ids) <= 4
    assert all(isinstance(t, int) and 0 <= t < len(tok) for t in token_ids)
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

    # on CPU the engine core is forked from the server (vime.backends.vllm_utils.cpu_server): a spawning server also
    # starts multiprocessing's resource tracker, and its core imports vLLM a second time
    (server,) = [
        c
        for c in psutil.Process(engine.proc.pid).children(recursive=True)
        if "vime.backends.vllm_utils.cpu_server" in fork_server.command_of(c)
    ]
    assert [c.name() for c in server.children()] == ["VLLM::EngineCore"], [
        c.cmdline() for c in server.children()
    ]


def _prompt_logprobs(engine_url: str, model: str, token_ids: list[int]) -> list[float]:
    """The engine's log-prob of each token of ``token_ids`` after the first."""
    body = {"model": model, "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0}
    resp = requests.post(f"{engine_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    entries = resp.json()["choices"][0]["prompt_logprobs"]
    return [entry[str(tok)]["logprob"] for tok, entry in zip(token_ids[1:], entries[1:], strict=True)]


@pytest.mark.timeout(180)
def test_control_routes_on_the_engine(served, tmp_path):
    engine = served.engine
    other_model = build_tiny_model(tmp_path / "seed1", seed=1, task=None, max_position_embeddings=CONTEXT)
    sequence = [*PROMPT, 12, 30, 8, 41, 3]

    async def main() -> None:
        async with EngineControlClient(engine.url) as client:
            assert await client.health()
            await client.pause("keep")
            assert await client.is_paused()
            await client.resume()
            assert not await client.is_paused()
            assert await client.reset_prefix_cache()

            # CPU: /sleep is accepted and is_sleeping flips, but nothing is freed (FACTS.md).
            assert not await client.is_sleeping()
            await client.sleep(level=1)
            assert await client.is_sleeping()
            await client.wake_up(tags=["weights", "kv_cache"])
            assert not await client.is_sleeping()

            before = await asyncio.to_thread(_prompt_logprobs, engine.url, served.model, sequence)
            assert await client.reload_weights(str(other_model)) == [None]
            changed = await asyncio.to_thread(_prompt_logprobs, engine.url, served.model, sequence)
            assert max(abs(a - b) for a, b in zip(before, changed, strict=True)) > 1e-3, (before, changed)
            await client.reload_weights(served.model)  # back to the shared model for the other tests
            restored = await asyncio.to_thread(_prompt_logprobs, engine.url, served.model, sequence)
            assert restored == pytest.approx(before, abs=1e-5)

            with pytest.raises(EngineControlError) as err:
                await client.collective_rpc("no_such_method")
            assert err.value.status == 500 and "no_such_method" in str(err.value)
            assert await client.health()  # a failed RPC does not take the engine down

    asyncio.run(main())

    # without the run's secret the control routes refuse, also when reached through the router's fallback
    for url in (engine.url, served.router.url):
        refused = requests.post(f"{url}/pause", params={"mode": "abort"}, timeout=30)
        assert refused.status_code == 403, (url, refused.status_code, refused.text)
    rpc = requests.post(f"{engine.url}/collective_rpc", json={"method": "reload_weights"}, timeout=30)
    assert rpc.status_code == 403
    assert asyncio.run(_is_paused(engine.url)) is False


async def _is_paused(url: str) -> bool:
    async with EngineControlClient(url) as client:
        return await client.is_paused()


# ~12 s of decoding alone; several times that beside another test worker on two cores (120 s ran out once)
@pytest.mark.timeout(300)
def test_pause_keep_freezes_in_flight_requests_until_resume(served):
    async def main() -> None:
        async with aiohttp.ClientSession() as session, EngineControlClient(served.engine.url) as client:
            request = await _pause_mid_flight(session, client, served, "keep", KEPT)
            assert not request.done(), "a kept request must not finish while the engine is paused"
            assert await client.reset_prefix_cache()
            await client.resume()
            status, result = await asyncio.wait_for(request, 280)
            assert status == 200
            for choice in result["choices"]:
                token_ids, _ = _tokens_and_logprobs(choice)
                assert choice["finish_reason"] == "length" and len(token_ids) == KEPT

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_pause_abort_returns_partial_responses_and_holds_new_requests(served):
    """The behaviour vime relies on to drop surplus requests: pause(abort) ends in-flight requests with HTTP
    200, finish_reason "abort" and the tokens/log-probs generated so far (possibly none); a request that
    arrives while paused is not aborted but waits for resume."""

    async def main() -> None:
        async with aiohttp.ClientSession() as session, EngineControlClient(served.engine.url) as client:
            request = await _pause_mid_flight(session, client, served, "abort")
            status, result = request.result()
            assert status == 200, result
            lengths = []
            for choice in result["choices"]:
                token_ids, _ = _tokens_and_logprobs(choice)
                assert choice["finish_reason"] == "abort", choice
                lengths.append(len(token_ids))
            assert max(lengths) < LONG
            assert result["usage"]["completion_tokens"] == sum(lengths)
            print(f"aborted after {lengths} tokens")

            held = asyncio.create_task(_post(session, served.router.url, _body(served, max_tokens=4)))
            await asyncio.sleep(1.0)
            assert not held.done(), "a request sent while paused must wait for resume"
            await client.resume()
            status, result = await asyncio.wait_for(held, 30)
            assert status == 200 and result["choices"][0]["finish_reason"] in {"stop", "length"}

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_failed_start_raises_with_the_log_tail(engine_factory, tmp_path):
    empty = tmp_path / "empty_model"
    empty.mkdir()
    start = time.monotonic()
    with pytest.raises(EngineStartError) as err:
        engine_factory(empty)
    elapsed = time.monotonic() - start
    message = str(err.value)
    assert "exited with code" in message and f"--model {empty}" in message
    assert "Invalid repository ID or local directory" in message  # vLLM's own error, from the log tail
    assert elapsed < 60, f"a failed start took {elapsed:.0f}s to report"


@pytest.mark.timeout(60)
def test_connect_router_external_or_started(make_args, router_factory, tiny_model_dir):
    external = router_factory()
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    args = make_args(
        tiny_model_dir, "--vllm-router-ip", "127.0.0.1", "--vllm-router-port", str(external.port)
    )
    url, started = connect_router(args)
    assert (url, started) == (external.url, None)
    assert {p.pid for p in me.children(recursive=True)} == before, "external mode must start no process"

    dead_port = ["--vllm-router-ip", "127.0.0.1", "--vllm-router-port", "1"]
    with pytest.raises(ConnectionError, match="--vllm-router-ip"):
        connect_router(make_args(tiny_model_dir, *dead_port))

    url, started = connect_router(make_args(tiny_model_dir, "--router-policy", "round_robin"))
    try:
        assert isinstance(started, RouterProcess) and started.is_alive() and url == started.url
        assert "--policy" in started.command and asyncio.run(list_workers(url)) == []
    finally:
        started.stop()
    assert started.live_processes() == [] and not started.is_alive()


@pytest.mark.timeout(120)
def test_stop_leaves_no_process_of_engine_or_router(served):
    """Last in the module: stops the shared engine and router."""
    engine, router = served.engine, served.router
    children = psutil.Process(engine.proc.pid).children(recursive=True)
    assert children, "expected vLLM's engine-core process under the API server"
    assert router.live_processes()
    for server in (engine, router):
        server.stop()
        assert server.live_processes() == [] and not server.is_alive()
        server.stop()  # idempotent
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in children)
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{engine.url}/health", timeout=5)
