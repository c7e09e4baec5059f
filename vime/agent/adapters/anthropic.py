"""The Anthropic Messages adapter (slime's ``AnthropicAdapter``): ``POST /v1/messages``, plain or streamed, and
``/v1/messages/count_tokens``, for Anthropic-API agent clients such as Claude Code. The session id is the bearer
token, else the ``X-Api-Key`` header, else ``default``."""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

from aiohttp import web

from vime.agent.adapters.common import (
    BaseAdapter,
    ParsedModelOutput,
    Reply,
    flatten_content,
    manager_finish_reason,
    sid_from_bearer,
    tool_call_dict,
)

logger = logging.getLogger(__name__)
_REMINDER = "<system-reminder>\n{}\n</system-reminder>\n"


class AnthropicAdapter(BaseAdapter):
    """Anthropic Messages on the policy's engines; see :mod:`vime.agent.adapters.common`."""

    logger = logger
    log_prefix = "anthropic_adapter"
    max_token_keys = ("max_tokens",)
    stop_keys = ("stop_sequences",)

    def _register_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self._run_turn)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)

    def _session_id(self, request: web.Request, body: dict) -> str:
        return sid_from_bearer(request) or (request.headers.get("X-Api-Key") or "").strip() or "default"

    def _preprocess_body(self, body: dict) -> None:
        fold_late_system_messages(body)

    def _translate(self, body: dict) -> tuple[list[dict], list[dict] | None]:
        return translate_messages(body.get("messages") or [], body.get("system")), chat_tools(
            body.get("tools")
        )

    def _build_reply(self, parsed: ParsedModelOutput, raw_finish: str, translated, tools_schema) -> Reply:
        blocks, stop_reason, recorded = reply_parts(parsed, raw_finish)
        return Reply(recorded, manager_finish_reason(parsed.tool_uses, raw_finish), (blocks, stop_reason))

    async def _respond(self, request, body, reply: Reply, in_tok: int, out_tok: int, stream: bool):
        blocks, stop_reason = reply.wire
        message = {
            "id": f"msg_{secrets.token_hex(12)}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model", "vime-actor"),
            "content": blocks,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": {"input_tokens": in_tok, "output_tokens": out_tok},
        }
        return await _stream(request, message) if stream else web.json_response(message)

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """The rendered prompt's token count (slime answers 0)."""
        body = await request.json()
        self._preprocess_body(body)
        translated, tools = self._translate(body)
        return web.json_response({"input_tokens": len(self._render(translated, tools))})


def translate_messages(messages: list[dict], system: Any = None) -> list[dict]:
    """Anthropic messages (and ``system``) as chat-template messages: a user turn's ``tool_result`` blocks become
    ``tool`` messages and its other blocks ``user`` messages; an assistant turn's text, ``thinking`` and
    ``tool_use`` blocks become one message with ``reasoning_content`` and ``tool_calls``."""
    out: list[dict] = [{"role": "system", "content": flatten_content(system)}] if system else []
    for message in messages:
        if not isinstance(message, dict):
            continue
        role, content = message.get("role"), message.get("content")
        blocks = (
            content if isinstance(content, list) else [{"type": "text", "text": flatten_content(content)}]
        )
        if role == "user":
            for block in blocks:
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    out.append({"role": "tool", "content": flatten_content(block.get("content"))})
                elif isinstance(block, dict) and block.get("type") == "text":
                    out.append({"role": "user", "content": block.get("text", "")})
                else:
                    out.append({"role": "user", "content": flatten_content([block])})
        elif role == "assistant":
            texts, thinking, calls = [], [], []
            for block in blocks:
                kind = block.get("type") if isinstance(block, dict) else None
                if kind == "text":
                    texts.append(block.get("text", ""))
                elif kind == "thinking":
                    thinking.append(block.get("thinking", ""))
                elif kind == "tool_use":
                    calls.append(tool_call_dict(block.get("name", "tool"), block.get("input")))
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if thinking:
                turn["reasoning_content"] = "".join(thinking)
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
        elif role == "system":
            out.append({"role": "system", "content": flatten_content(content)})
    return out


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Anthropic tools (``name``, ``description``, ``input_schema``) as chat-template function tools."""
    out = [
        {
            "type": "function",
            "function": {
                "name": tool["name"],
                "description": tool.get("description", ""),
                "parameters": tool.get("input_schema")
                or tool.get("parameters")
                or {"type": "object", "properties": {}},
            },
        }
        for tool in tools or []
        if isinstance(tool, dict) and tool.get("name")
    ]
    return out or None


def reply_parts(parsed: ParsedModelOutput, finish: str) -> tuple[list[dict], str, dict]:
    """(the reply's content blocks, its stop reason, the message recorded for the next turn's history)."""
    blocks: list[dict] = []
    if parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning})
    if parsed.text:
        blocks.append({"type": "text", "text": parsed.text})
    for use in parsed.tool_uses:
        blocks.append(
            {
                "type": "tool_use",
                "id": f"toolu_{secrets.token_hex(8)}",
                "name": use["name"],
                "input": use["input"],
            }
        )
    blocks = blocks or [{"type": "text", "text": ""}]
    stop_reason = "tool_use" if parsed.tool_uses else ("max_tokens" if finish == "length" else "end_turn")
    recorded: dict[str, Any] = {"role": "assistant", "content": parsed.text or ""}
    if parsed.reasoning:
        recorded["reasoning_content"] = parsed.reasoning
    if parsed.tool_uses:
        recorded["tool_calls"] = [tool_call_dict(use["name"], use["input"]) for use in parsed.tool_uses]
    return blocks, stop_reason, recorded


def fold_late_system_messages(body: dict) -> bool:
    """Move every ``system`` message after the first position into the nearest earlier ``user`` message (else the
    next one) as a ``<system-reminder>`` text block: chat templates take a system message first only. Changes
    ``body`` in place; whether anything moved."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    late = [i for i, m in enumerate(messages) if i > 0 and isinstance(m, dict) and m.get("role") == "system"]
    moved = set()
    for i in late:
        block = {"type": "text", "text": _REMINDER.format(flatten_content(messages[i].get("content")))}
        earlier = [j for j in range(i - 1, -1, -1) if messages[j].get("role") == "user"]
        later = [j for j in range(i + 1, len(messages)) if messages[j].get("role") == "user"]
        if not earlier and not later:
            continue  # no user message to carry it: left where it is
        target = messages[(earlier or later)[0]]
        if not isinstance(target.get("content"), list):
            target["content"] = [{"type": "text", "text": target.get("content") or ""}]
        if earlier:
            target["content"].append(block)
        else:
            target["content"].insert(0, block)
        moved.add(i)
    body["messages"] = [m for i, m in enumerate(messages) if i not in moved]
    return bool(moved)


async def _stream(request, message: dict) -> web.StreamResponse:
    """The finished message as Anthropic's events: ``message_start``, a start/delta/stop triple per content block,
    ``message_delta`` with the stop reason and usage, ``message_stop``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def event(name: str, data: dict) -> None:
        await response.write(
            f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n".encode()
        )

    usage = message["usage"]
    start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 0}}
    await event("message_start", {"message": start})
    for index, block in enumerate(message["content"]):
        if block["type"] == "thinking":
            empty, delta = (
                {"type": "thinking", "thinking": ""},
                {"type": "thinking_delta", "thinking": block["thinking"]},
            )
        elif block["type"] == "text":
            empty, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            empty = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            delta = {
                "type": "input_json_delta",
                "partial_json": json.dumps(block["input"], ensure_ascii=False),
            }
        await event("content_block_start", {"index": index, "content_block": empty})
        await event("content_block_delta", {"index": index, "delta": delta})
        await event("content_block_stop", {"index": index})
    await event(
        "message_delta",
        {"delta": {"stop_reason": message["stop_reason"], "stop_sequence": None}, "usage": usage},
    )
    await event("message_stop", {})
    return response
