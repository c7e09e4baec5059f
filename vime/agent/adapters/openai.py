"""The OpenAI Chat Completions adapter (slime's ``OpenAIAdapter``): ``POST /v1/chat/completions``, plain or streamed
(server-sent events), for OpenAI-compatible agent clients such as the Codex CLI. The session id is the bearer token
(the client's API key), else ``metadata.session_id`` or ``user``, else ``default``."""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any

from aiohttp import web

from vime.agent.adapters.common import (
    BaseAdapter,
    ParsedModelOutput,
    Reply,
    flatten_content,
    manager_finish_reason,
    sid_from_bearer,
    sid_from_body,
    tool_call_dict,
)

logger = logging.getLogger(__name__)


class OpenAIAdapter(BaseAdapter):
    """OpenAI Chat Completions on the policy's engines; see :mod:`vime.agent.adapters.common`."""

    logger = logger
    log_prefix = "openai_adapter"
    max_token_keys = ("max_completion_tokens", "max_tokens", "max_output_tokens")
    stop_keys = ("stop",)

    def _register_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._run_turn)

    def _session_id(self, request: web.Request, body: dict) -> str:
        return sid_from_bearer(request) or sid_from_body(body) or "default"

    def _translate(self, body: dict) -> tuple[list[dict], list[dict] | None]:
        messages = body.get("messages") or []
        if not isinstance(messages, list):
            raise web.HTTPBadRequest(text="messages must be a list")
        return translate_messages(messages), chat_tools(body.get("tools"))

    def _build_reply(self, parsed: ParsedModelOutput, raw_finish: str, translated, tools_schema) -> Reply:
        wire, manager_message, finish = reply_parts(parsed, raw_finish)
        return Reply(manager_message, manager_finish_reason(parsed.tool_uses, raw_finish), (wire, finish))

    async def _respond(self, request, body, reply: Reply, in_tok: int, out_tok: int, stream: bool):
        message, finish = reply.wire
        if stream:
            return await _stream(request, body, message, finish, in_tok, out_tok)
        return web.json_response(
            {
                "id": f"chatcmpl_{secrets.token_hex(12)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "vime-actor"),
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": _usage(in_tok, out_tok),
            }
        )


def translate_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages as chat-template messages: ``developer`` is ``system``, content flattened to text,
    tool-call arguments as dicts, the wire's call ids dropped (unknown roles are left out)."""
    out: list[dict] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = "system" if message.get("role") == "developer" else message.get("role")
        content = flatten_content(message.get("content"))
        if role in ("system", "user", "tool"):
            out.append({"role": role, "content": content})
        elif role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": content}
            if message.get("reasoning_content"):
                turn["reasoning_content"] = message["reasoning_content"]
            calls = []
            for call in message.get("tool_calls") or []:
                if isinstance(call, dict):
                    function = call.get("function") or {}
                    arguments = function.get("arguments", call.get("arguments"))
                    calls.append(
                        tool_call_dict(
                            function.get("name") or call.get("name") or "tool", _as_dict(arguments)
                        )
                    )
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    return out


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """OpenAI tools (or bare ``{name, description, parameters}``) as chat-template function tools."""
    out = []
    for tool in tools or []:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            continue
        function = tool["function"] if isinstance(tool.get("function"), dict) else tool
        if function.get("name"):
            out.append(
                {
                    "type": "function",
                    "function": {
                        "name": function["name"],
                        "description": function.get("description", ""),
                        "parameters": function.get("parameters") or {"type": "object", "properties": {}},
                    },
                }
            )
    return out or None


def reply_parts(parsed: ParsedModelOutput, finish: str) -> tuple[dict, dict, str]:
    """(the wire message, the message recorded for the next turn's history, the wire finish reason). The wire has
    one tool call at most, its arguments as a JSON string and ``content: null`` beside it (some clients split a
    mixed message or drop parallel calls, and the echo must match what was recorded)."""
    calls = parsed.tool_uses[:1]
    wire: dict[str, Any] = {"role": "assistant", "content": None if calls else (parsed.text or None)}
    recorded: dict[str, Any] = {"role": "assistant", "content": "" if calls else (parsed.text or "")}
    if parsed.reasoning:
        wire["reasoning_content"] = parsed.reasoning
    if calls:
        wire["tool_calls"] = [
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {
                    "name": c["name"],
                    "arguments": json.dumps(c["input"], ensure_ascii=False, sort_keys=True),
                },
            }
            for c in calls
        ]
        recorded["tool_calls"] = [tool_call_dict(c["name"], c["input"]) for c in calls]
    wire_finish = "tool_calls" if calls else ("length" if finish == "length" else "stop")
    return wire, recorded, wire_finish


def _as_dict(arguments: Any) -> dict:
    if isinstance(arguments, dict):
        return arguments
    if not arguments:
        return {}
    try:
        value = json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        return {"_raw_arguments": str(arguments)}
    return value if isinstance(value, dict) else {"_raw_arguments": str(arguments)}


def _usage(in_tok: int, out_tok: int) -> dict[str, int]:
    return {"prompt_tokens": in_tok, "completion_tokens": out_tok, "total_tokens": in_tok + out_tok}


async def _stream(
    request, body: dict, message: dict, finish: str, in_tok: int, out_tok: int
) -> web.StreamResponse:
    """The finished turn as Chat Completions chunks: the role, then reasoning, content and all tool calls in one
    chunk each, the finish reason with usage, ``[DONE]``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    base = {
        "id": f"chatcmpl_{secrets.token_hex(12)}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": body.get("model", "vime-actor"),
    }

    async def chunk(delta: dict, finish_reason: str | None = None, **extra: Any) -> None:
        data = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}], **extra}
        await response.write(f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode())

    await chunk({"role": "assistant"})
    if message.get("reasoning_content"):
        await chunk({"reasoning_content": message["reasoning_content"]})
    if message.get("content"):
        await chunk({"content": message["content"]})
    if message.get("tool_calls"):
        await chunk({"tool_calls": [{**call, "index": i} for i, call in enumerate(message["tool_calls"])]})
    await chunk({}, finish, usage=_usage(in_tok, out_tok))
    await response.write(b"data: [DONE]\n\n")
    return response
