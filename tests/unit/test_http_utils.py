"""vime.utils.http_utils (slime's plug-in helper): JSON post with retries and get, against a local aiohttp server."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from vime.rollout.base_types import RolloutFnTrainOutput
from vime.utils import http_utils
from vime.utils.misc import free_port
from vime.utils.types import RolloutFnTrainOutput as Same


async def _serve(handler_map):
    app = web.Application()
    for path, handler in handler_map.items():
        app.router.add_route("*", path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def test_post_retries_until_the_server_answers_and_get_reads_json():
    calls = []

    async def flaky(request):
        calls.append(await request.json())
        if len(calls) < 3:
            return web.Response(status=503, text="warming up")
        return web.json_response({"echo": calls[-1]})

    async def text(request):
        return web.Response(text="plain")

    async def numbers(request):
        return web.json_response([1, 2])

    async def main():
        runner, url = await _serve({"/flaky": flaky, "/text": text, "/json": numbers})
        try:
            assert await http_utils.post(f"{url}/flaky", {"x": 1}, max_retries=5) == {"echo": {"x": 1}}
            assert len(calls) == 3
            assert await http_utils.post(f"{url}/text", None) == "plain"
            assert await http_utils.get(f"{url}/json") == [1, 2]
            calls.clear()
            with pytest.raises(aiohttp.ClientResponseError) as err:
                await http_utils.post(f"{url}/flaky", {}, max_retries=2)
            assert err.value.status == 503 and len(calls) == 2
        finally:
            await runner.cleanup()
            await http_utils._session().close()

    asyncio.run(main())


def test_base_types_are_the_rollout_output_types():
    assert RolloutFnTrainOutput is Same


def test_client_errors_are_not_retried():
    calls = []

    async def bad(request):
        calls.append(1)
        return web.Response(status=400, text="prompt too long")

    async def main():
        runner, url = await _serve({"/bad": bad})
        try:
            with pytest.raises(http_utils.RequestRefusedError) as err:
                await http_utils.post(f"{url}/bad", {}, max_retries=5)
            assert err.value.status == 400 and "prompt too long" in err.value.message and calls == [1]
        finally:
            await runner.cleanup()
            await http_utils._session().close()

    asyncio.run(main())
