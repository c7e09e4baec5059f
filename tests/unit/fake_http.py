"""A local aiohttp server for unit tests that stand in for an HTTP service (a fake vLLM, a reward server)."""

from __future__ import annotations

from aiohttp import web

from vime.utils.misc import free_port


async def serve_posts(routes: dict) -> tuple[web.AppRunner, str]:
    """Serve ``{path: handler}`` as POST routes on loopback; the runner (``await runner.cleanup()`` ends it) and
    the base URL."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"
