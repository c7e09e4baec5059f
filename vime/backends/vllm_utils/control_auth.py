"""A per-run secret on the engines' control routes.

vLLM's dev-mode routes (``/pause``, ``/collective_rpc``, ``/sleep``, weight updates...) answer anyone, and
vllm-router forwards paths it does not know to an engine, so without this any local process could pause the
engines or join the weight-update group through the router's port. Every engine runs
:func:`require_control_secret` as an ASGI middleware (``--middleware``): requests outside the public inference
and health routes must carry the run's secret in the ``X-Vime-Control-Secret`` header, which
:class:`~.control_client.EngineControlClient` adds. The secret lives in ``VIME_CONTROL_SECRET``: made by the
first process of a run that needs it, inherited by the engines it starts and handed to Ray workers by
``vime.ray.run.init_ray``.
"""

from __future__ import annotations

import hmac
import os
import secrets

SECRET_ENV = "VIME_CONTROL_SECRET"
HEADER = "X-Vime-Control-Secret"
MIDDLEWARE = f"{__name__}.require_control_secret"
# Inference, health and read-only information: open to the router and any client, as on a plain vLLM server.
PUBLIC_PREFIXES = ("/v1/", "/inference/v1/generate", "/health", "/ping", "/version", "/metrics", "/load",
                   "/tokenize", "/detokenize", "/server_info", "/docs", "/openapi.json")  # fmt: skip


def run_secret() -> str:
    """This run's control secret (created on first use in this process tree)."""
    return os.environ.setdefault(SECRET_ENV, secrets.token_hex(16))


def is_public(path: str) -> bool:
    return path.startswith(PUBLIC_PREFIXES) or path == "/"


async def require_control_secret(request, call_next):
    """vLLM server middleware: refuse (HTTP 403) control routes without the run's secret."""
    from starlette.responses import JSONResponse

    expected = os.environ.get(SECRET_ENV)
    if expected is None:
        return JSONResponse({"error": f"{SECRET_ENV} is not set on this server"}, status_code=500)
    if is_public(request.url.path) or hmac.compare_digest(request.headers.get(HEADER, ""), expected):
        return await call_next(request)
    return JSONResponse(
        {"error": f"{request.url.path} is a control route of a vime run: it needs the run's {HEADER} header"},
        status_code=403,
    )
