"""The shared engine pool (``tests/e2e/conftest.py``): whatever a test leaves in a pooled engine, the next user gets the
checkpoint's weights back, unpaused, so pooled tests do not depend on their order; and the pooled engine with two
API-server processes is controlled through either of them. Adds no engine start."""

from __future__ import annotations

import asyncio
import urllib.request

import psutil
import pytest
import torch
from conftest import POOL_API_SERVERS, PROBE_TOKENS
from transformers import AutoModelForCausalLM

from vime.backends.vllm_utils.control_client import EngineControlClient, EngineGroup

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_the_next_user_of_a_pooled_engine_sees_the_base_log_probs(engine_pool, tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(tmp_path / "perturbed")
    urls, name = engine_pool.urls, str(tiny_model_dir)

    async def leave_a_mess(engine):
        await engine.reload_weights(str(tmp_path / "perturbed"))
        await engine.prompt_log_probs(name, PROBE_TOKENS)  # cached under the perturbed weights
        await engine.pause(mode="keep")

    with EngineGroup(urls) as engines:
        engines.run(leave_a_mess)
        assert engines.run(lambda engine: engine.is_paused()) == [True] * len(urls)
        engines.run(lambda engine: engine.resume())
        changed = engines.run(lambda engine: engine.prompt_log_probs(name, PROBE_TOKENS))
        engines.run(lambda engine: engine.pause(mode="keep"))
    assert all(
        max(abs(a - b) for a, b in zip(got, base, strict=True)) > 1e-3
        for got, base in zip(changed, engine_pool.base_log_probs, strict=True)
    ), "the perturbed weights did not reach the engines"

    engine_pool.reset()  # what the next test's engine_pool fixture does
    with EngineGroup(urls) as engines:
        assert engines.run(lambda engine: engine.is_paused()) == [False] * len(urls)
        again = engines.run(lambda engine: engine.prompt_log_probs(name, PROBE_TOKENS))
    assert again == engine_pool.base_log_probs


def _connections(front_ends: list[psutil.Process], port: int) -> list[int]:
    """Open client connections each of ``front_ends`` (API-server processes) serves on ``port``."""
    return [
        sum(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port for c in p.net_connections("tcp"))
        for p in front_ends
    ]


async def _client_per_front_end(
    url: str, front_ends: list[psutil.Process], port: int, opened: list[EngineControlClient]
) -> list[EngineControlClient]:
    """A control client connected to each of ``front_ends``: new clients (each keeping its connection open, added to
    ``opened``) until every front-end has one (vLLM hands a connection to the least loaded, when it is quick enough)."""
    found: dict[int, EngineControlClient] = {}
    while len(found) < len(front_ends) and len(opened) < 4 * len(front_ends):
        client = EngineControlClient(url)
        opened.append(client)
        before = _connections(front_ends, port)
        await client.is_paused()
        grown = [
            i for i, (a, b) in enumerate(zip(before, _connections(front_ends, port), strict=True)) if b > a
        ]
        if len(grown) == 1:
            found.setdefault(grown[0], client)
    assert len(found) == len(front_ends), f"connections reached front-ends {sorted(found)} only"
    return [found[i] for i in sorted(found)]


def _requests_served(url: str) -> float:
    """``vllm:request_success_total`` of the engine at ``url``, over every finish reason."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:request_success_total{")
    )


def test_either_front_end_of_an_engine_with_two_api_servers_controls_its_one_core(
    engine_pool, tiny_model_dir
):
    engine, name = engine_pool.engines[-1], str(tiny_model_dir)
    front_ends = [p for p in engine.live_processes() if p.name().startswith("VLLM::APIServer")]
    assert len(front_ends) == POOL_API_SERVERS, f"{engine.command} runs {len(front_ends)} API servers"
    served = _requests_served(engine.url)

    async def check() -> None:
        opened: list[EngineControlClient] = []
        try:
            a, b = await _client_per_front_end(engine.url, front_ends, engine.port, opened)
            await a.pause(mode="keep")
            assert await b.is_paused()
            held = asyncio.ensure_future(b.prompt_log_probs(name, PROBE_TOKENS))
            await asyncio.sleep(1.0)
            assert not held.done(), "a request on the other front-end ran while the engine was paused"
            await a.resume()
            assert await asyncio.wait_for(held, 30) == engine_pool.base_log_probs[-1]
            assert await a.prompt_log_probs(name, PROBE_TOKENS) == engine_pool.base_log_probs[-1]
            await a.sleep(level=1)
            assert await b.is_sleeping()
            await b.wake_up()
            assert not await a.is_sleeping()
        finally:
            await asyncio.gather(*(client.close() for client in opened))

    asyncio.run(check())
    # /metrics, from whichever front-end answers, counts the requests both served
    assert _requests_served(engine.url) == served + 2
