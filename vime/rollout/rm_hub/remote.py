"""``--rm-type remote_rm``: ask an HTTP reward server at ``--rm-url``."""

from __future__ import annotations

from typing import Any

import aiohttp

from vime.utils.types import Sample


async def remote_rm(args: Any, sample: Sample) -> float | dict[str, Any]:
    """POST ``{"prompt", "response", "label", "metadata"}`` as JSON to ``args.rm_url``.

    Returns the body's ``reward`` field, the body itself if it is a number, or else the whole JSON object
    (a dict reward, indexed later by ``--reward-key``). Non-2xx responses raise ``RuntimeError`` with the
    status and the start of the body. No client timeout: ``--rm-timeout`` bounds the call.
    """
    url = getattr(args, "rm_url", None)
    if not url:
        raise ValueError("--rm-type remote_rm needs --rm-url (the reward server's URL)")
    payload = {
        "prompt": sample.prompt,
        "response": sample.response,
        "label": sample.label,
        "metadata": sample.metadata,
    }
    # One session per call keeps this usable from any event loop; the connection is not pooled.
    async with aiohttp.ClientSession() as session, session.post(url, json=payload) as resp:
        if resp.status >= 400:
            body = await resp.text()
            raise RuntimeError(f"reward server {url} returned HTTP {resp.status}: {body[:200]}")
        result = await resp.json(content_type=None)
    if isinstance(result, dict) and "reward" in result:
        return result["reward"]
    if isinstance(result, int | float | dict):
        return result
    raise ValueError(
        f"reward server {url} returned {type(result).__name__} JSON; expected a number or an object"
    )
