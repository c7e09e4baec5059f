"""An OpenAI-compatible endpoint for one sample, so agents written against the OpenAI SDK train with vime.

Inside a custom generate function::

    async with openai_endpoint(args, sample, sampling_params) as base_url:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="vime")
        await my_agent(client, sample.prompt)            # any code that calls client.chat.completions.create
    return sample                                         # holds every turn's tokens, log-probs and loss mask

The endpoint listens on ``127.0.0.1`` on a free port for the duration of the ``async with`` and serves
``POST /v1/chat/completions`` (and ``GET /v1/models``) through a :class:`~vime.rollout.chat_recorder.ChatRecorder`,
so the sample records exactly the tokens the engine saw and generated. A bad request is answered with HTTP 400
(the SDK raises ``BadRequestError``); when the rollout aborts the sample the answer is 400 too and the sample keeps
its ABORTED status. A fatal error (the router is gone) is raised again when the ``async with`` block ends.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from vime.rollout.chat_recorder import ChatRecorder, ChatRequestError, GenerationStopped
from vime.utils.types import Sample


@contextlib.asynccontextmanager
async def openai_endpoint(
    args, sample: Sample, sampling_params: dict[str, Any], tool_parser: str | None = None
) -> AsyncIterator[str]:
    """Serve OpenAI chat completions recorded into ``sample``; yields the base URL (``http://127.0.0.1:PORT/v1``)."""
    recorder = ChatRecorder(args, sample, sampling_params, tool_parser)
    fatal: list[BaseException] = []

    async def chat_completions(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            return web.json_response(await recorder.create(body))
        except (ChatRequestError, GenerationStopped, ValueError) as exc:
            kind = "generation_stopped" if isinstance(exc, GenerationStopped) else "invalid_request_error"
            return web.json_response({"error": {"message": str(exc), "type": kind}}, status=400)
        except Exception as exc:  # e.g. the router is gone: the rollout must fail, not just this agent
            fatal.append(exc)
            return web.json_response({"error": {"message": repr(exc), "type": "server_error"}}, status=500)

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": args.hf_checkpoint, "object": "model", "owned_by": "vime"}]}
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        await web.SockSite(runner, sock).start()
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        await runner.cleanup()
        sock.close()
    if fatal:
        raise fatal[0]
