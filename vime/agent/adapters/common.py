"""What the OpenAI and Anthropic adapters share: the session life cycle, the one-turn pipeline and the trajectory
each session becomes (slime's ``slime.agent.adapters.common``, built on vime's parts).

An agent CLI (Codex, Claude Code, any client of those APIs) points at the adapter; each request carries its session
id (``Authorization: Bearer <sid>``, or the body's ``metadata.session_id`` / ``user``). One turn: the protocol's
messages become chat-template messages, the served model's chat template renders them to token ids, the policy
generates through slime's SGLang ``/generate`` request (answered by vLLM, :func:`vime.utils.http_utils.post`), vLLM's
reasoning and tool parsers (``tool_parser`` / ``reasoning_parser``: vLLM's names, e.g. ``hermes``, ``qwen3``) split the
text, and the reply goes back in the protocol's shape.

The session's trajectory: each turn whose prompt tokens extend the tokens held so far continues the current sample
(the new prompt tokens with loss mask 0, the generated tokens with loss mask 1 and their log-probs); a turn whose
prompt diverges (a sub-agent, a compacted history, a re-rendered past turn) opens a new sample. slime's trajectory
manager also heals a short divergence inside the latest response (``fork_threshold_tokens``); vime forks on every
divergence instead, so each sample holds exactly the tokens its model calls saw and produced.
:meth:`BaseAdapter.finish_session` returns the samples, one per fork, sharing the trajectory's ``rollout_id``.

Sampling follows the session's defaults (the generate function's ``sampling_params``, the rollout's temperature):
the trainer recomputes log-probs at ``--rollout-temperature``, so a client's own ``temperature``/``top_p``/``top_k``
is not applied (logged once per session); its token limit and stop sequences are.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from vime.rollout.chat_recorder import chat_request, tool_parser_class
from vime.utils.http_utils import close_session, post
from vime.utils.sglang_compat import SamplingParams
from vime.utils.types import Sample, Status

_DEFAULT_MAX_NEW_TOKENS = 4096
_CLIENT_SAMPLING = ("temperature", "top_p", "top_k")


def flatten_content(content: Any) -> str:
    """A message's content (a string, or OpenAI/Anthropic content blocks) as one chat-template string: text blocks
    joined by newlines, tool results and nested content flattened, images as ``[image omitted]``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return str(content)
    parts = []
    for block in content:
        if not isinstance(block, dict):
            parts.append(str(block))
            continue
        kind = block.get("type")
        if kind in ("text", "input_text", "output_text"):
            parts.append(block.get("text", ""))
        elif kind in ("image", "image_url", "input_image"):
            parts.append("[image omitted]")
        elif "content" in block:  # tool_result and other containers
            parts.append(flatten_content(block.get("content")))
        elif "text" in block:
            parts.append(str(block.get("text") or ""))
    return "\n".join(part for part in parts if part)


def tool_call_dict(name: str, arguments: dict | None) -> dict:
    """A tool call as the chat template takes it: arguments as a mapping, no wire id."""
    return {"type": "function", "function": {"name": name, "arguments": arguments or {}}}


def manager_finish_reason(tool_uses: list[dict], raw_finish: str) -> str:
    """``tool_calls`` when the turn called a tool, else the engine's finish reason."""
    return "tool_calls" if tool_uses else (raw_finish or "stop")


def sid_from_bearer(request: web.Request) -> str | None:
    """The session id in ``Authorization: Bearer <sid>`` (where a client puts its API key), or None."""
    auth = request.headers.get("Authorization", "")
    return (auth[7:].strip() or None) if auth.lower().startswith("bearer ") else None


def sid_from_body(body: dict | None) -> str | None:
    """The session id in an OpenAI body (``metadata.session_id``, else ``user``), or None."""
    metadata = (body or {}).get("metadata")
    if isinstance(metadata, dict) and metadata.get("session_id"):
        return str(metadata["session_id"])
    return str(body["user"]) if body and body.get("user") else None


@dataclasses.dataclass(frozen=True)
class TurnRecord:
    """One model call: its prompt and output token ids, finish reason and the output's log-probs."""

    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    output_log_probs: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ParsedModelOutput:
    """A turn's text split by the parsers: ``tool_uses`` are ``{"name", "input": dict}``."""

    text: str
    reasoning: str | None = None
    tool_uses: list[dict] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Reply:
    """What an adapter's ``_build_reply`` gives the pipeline: the wire form is the adapter's own."""

    manager_message: dict
    finish_reason: str
    wire: Any


@dataclasses.dataclass
class _Chain:
    """One sample of a session's trajectory: the tokens so far, their loss mask and log-probs."""

    prompt_length: int
    tokens: list[int]
    loss_mask: list[int]
    log_probs: list[float]
    finish_reason: str = "stop"

    def extends(self, turn: TurnRecord) -> bool:
        return turn.prompt_ids[: len(self.tokens)] == self.tokens

    def append(self, turn: TurnRecord) -> None:
        tail = turn.prompt_ids[len(self.tokens) :]
        self.tokens += tail + turn.output_ids
        self.loss_mask += [0] * len(tail) + [1] * len(turn.output_ids)
        self.log_probs += [0.0] * len(tail) + list(turn.output_log_probs)
        self.finish_reason = turn.finish_reason


@dataclasses.dataclass
class Session:
    """A session's sampling defaults, context budget and trajectory."""

    sampling_defaults: dict = dataclasses.field(default_factory=dict)
    max_context_tokens: int = 0
    chains: list[_Chain] = dataclasses.field(default_factory=list)
    warned_sampling: bool = False

    def record(self, turn: TurnRecord) -> None:
        if self.chains and self.chains[-1].extends(turn):
            self.chains[-1].append(turn)
            return
        chain = _Chain(len(turn.prompt_ids), [], [], [])
        chain.append(turn)
        chain.loss_mask[: chain.prompt_length] = []  # the prompt is not part of the response
        chain.log_probs[: chain.prompt_length] = []
        self.chains.append(chain)


class BaseAdapter:
    """An HTTP adapter: the session life cycle and the one-turn pipeline; a protocol subclass supplies
    ``_register_routes``, ``_session_id``, ``_translate``, ``_build_reply``, ``_respond`` (and may
    ``_preprocess_body``), and the body keys of its token limit (``max_token_keys``) and stop sequences
    (``stop_keys``)."""

    logger: logging.Logger = logging.getLogger(__name__)
    log_prefix = "adapter"
    max_token_keys: tuple[str, ...] = ()
    stop_keys: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        tokenizer,
        sglang_url: str,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        max_turns_per_sid: int | None = None,
        fork_threshold_tokens: int | None = None,
        debug_callback: Callable[..., None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.sglang_url = sglang_url.rstrip("/")
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.max_turns_per_sid = max_turns_per_sid
        self.debug_callback = debug_callback
        if fork_threshold_tokens is not None:
            self.logger.info(
                "[%s] fork_threshold_tokens=%s: vime opens a new sample on every prompt divergence (no healing)",
                self.log_prefix,
                fork_threshold_tokens,
            )
        self.store: dict[str, Session] = {}
        self.inflight: dict[str, set[asyncio.Task]] = {}
        self.closed: set[str] = set()
        self._turns: dict[str, int] = {}
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_get("/healthz", _health)
        self.app.router.add_get("/v1/models", _health)
        self.app.on_cleanup.append(_close_http_session)  # the engine requests' session on the app's loop
        self._register_routes(self.app)

    # -- protocol hooks -------------------------------------------------------------------------------------
    def _register_routes(self, app: web.Application) -> None:
        raise NotImplementedError

    def _session_id(self, request: web.Request, body: dict) -> str:
        raise NotImplementedError

    def _preprocess_body(self, body: dict) -> None:
        """Change the parsed body in place before anything reads it (default: nothing)."""

    def _translate(self, body: dict) -> tuple[list[dict], list[dict] | None]:
        raise NotImplementedError

    def _build_reply(self, parsed: ParsedModelOutput, raw_finish: str, translated, tools_schema) -> Reply:
        raise NotImplementedError

    async def _respond(self, request, body, reply: Reply, in_tok: int, out_tok: int, stream: bool):
        raise NotImplementedError

    # -- sessions -------------------------------------------------------------------------------------------
    def open_session(
        self, sid: str, *, sampling_defaults: dict | None = None, max_context_tokens: int = 0
    ) -> None:
        """Start session ``sid`` (ids are unique per agent run) with its sampling defaults and token budget."""
        if sid in self.store:
            raise ValueError(f"session_id {sid!r} already exists; session ids must be unique per agent run")
        self.closed.discard(sid)
        self.store[sid] = Session(dict(sampling_defaults or {}), int(max_context_tokens or 0))

    async def shutdown_session(self, sid: str, *, wait_timeout: float = 5.0) -> None:
        """Refuse further requests of ``sid`` and wait (then cancel) its turns in flight."""
        self.closed.add(sid)
        tasks = [task for task in self.inflight.pop(sid, ()) if not task.done()]
        if not tasks:
            return

        async def drain() -> None:
            _, pending = await asyncio.wait(tasks, timeout=wait_timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        # the turns run on the adapter's own loop (run_app_in_thread); wait for them there
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(drain(), tasks[0].get_loop()))

    async def finish_session(
        self,
        sid: str,
        *,
        base_sample: Sample,
        reward: float = 0.0,
        extra_metadata: dict | None = None,
        wait_timeout: float = 5.0,
    ) -> list[Sample]:
        """The session's trajectory as samples (one per fork; none if it made no call), each a copy of
        ``base_sample`` with the recorded tokens, ``reward`` and ``extra_metadata``; the session ends."""
        await self.shutdown_session(sid, wait_timeout=wait_timeout)
        session = self.store.pop(sid, None)
        self._turns.pop(sid, None)
        if session is None:
            return []
        samples = []
        for chain in session.chains:
            sample = copy.deepcopy(base_sample)
            sample.tokens = list(chain.tokens)
            sample.response_length = len(chain.tokens) - chain.prompt_length
            sample.loss_mask = list(chain.loss_mask)
            sample.rollout_log_probs = list(chain.log_probs)
            sample.response = self.tokenizer.decode(
                chain.tokens[chain.prompt_length :], skip_special_tokens=False
            )
            sample.reward = reward
            sample.metadata = {**(sample.metadata or {}), **(extra_metadata or {})}
            sample.status = Status.from_finish_reason(chain.finish_reason)
            samples.append(sample)
        if len(samples) > 1:  # one trajectory: the loss averages over it once
            for sample in samples:
                sample.rollout_id = (
                    base_sample.rollout_id if base_sample.rollout_id is not None else base_sample.index
                )
        return samples

    async def drop_session(self, sid: str, *, wait_timeout: float = 5.0) -> None:
        """End ``sid`` without samples (idempotent)."""
        await self.shutdown_session(sid, wait_timeout=wait_timeout)
        self.store.pop(sid, None)
        self._turns.pop(sid, None)

    # -- one turn -------------------------------------------------------------------------------------------
    async def _run_turn(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self._preprocess_body(body)
        sid = self._session_id(request, body)
        if sid in self.closed:
            return web.Response(status=503, text="session closed")
        if self.max_turns_per_sid is not None:
            if self._turns.get(sid, 0) >= self.max_turns_per_sid:
                message = f"adapter: sid {sid!r} exceeded max_turns_per_sid={self.max_turns_per_sid}"
                return web.json_response(
                    {"error": {"type": "rate_limit_error", "message": message}}, status=429
                )
            self._turns[sid] = self._turns.get(sid, 0) + 1
        session = self.store.setdefault(sid, Session())
        task = asyncio.current_task()
        self.inflight.setdefault(sid, set()).add(task)
        try:
            translated, tools_schema = self._translate(body)
            prompt_ids = self._render(translated, tools_schema)
            turn = await self._generate(prompt_ids, session, body, sid)
            text = (
                self.tokenizer.decode(turn.output_ids, skip_special_tokens=False) if turn.output_ids else ""
            )
            parsed = self._parse(text, translated, tools_schema)
            reply = self._build_reply(parsed, turn.finish_reason, translated, tools_schema)
            stream = body.get("stream") is True or "text/event-stream" in request.headers.get("Accept", "")
            response = await self._respond(
                request, body, reply, len(prompt_ids), len(turn.output_ids), stream
            )
            if self.debug_callback is not None:
                self.debug_callback(sid, translated, tools_schema, reply.manager_message, turn)
            session.record(turn)  # after the reply is out: a turn the client never got is not trained on
            return response
        finally:
            self.inflight.get(sid, set()).discard(task)

    def _render(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=True, add_generation_prompt=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _sampling_params(self, session: Session, body: dict, sid: str) -> SamplingParams:
        params = SamplingParams(
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            no_stop_trim=True,
            max_new_tokens=_DEFAULT_MAX_NEW_TOKENS,
        )
        params.update(session.sampling_defaults)
        for key in self.max_token_keys:
            if body.get(key) is not None:
                params["max_new_tokens"] = min(int(params["max_new_tokens"]), int(body[key]))
                break
        for key in self.stop_keys:
            if body.get(key):
                params["stop"] = body[key]
                break
        asked = {k: body[k] for k in _CLIENT_SAMPLING if k in body and body[k] != params.get(k)}
        if asked and not session.warned_sampling:
            session.warned_sampling = True
            self.logger.warning(
                "[%s] sid=%s asks for %s; the rollout's sampling is kept (the trainer's log-probs assume it)",
                self.log_prefix,
                sid,
                asked,
            )
        return params

    async def _generate(self, prompt_ids: list[int], session: Session, body: dict, sid: str) -> TurnRecord:
        params = self._sampling_params(session, body, sid)
        if session.max_context_tokens > 0:
            room = session.max_context_tokens - len(prompt_ids)
            if room <= 0:
                return TurnRecord(list(prompt_ids), [], "length")
            params["max_new_tokens"] = min(int(params["max_new_tokens"]), room)
        payload = {"input_ids": prompt_ids, "sampling_params": dict(params), "return_logprob": True}
        output = await post(f"{self.sglang_url}/generate", payload)
        pairs = output["meta_info"].get("output_token_logprobs") or []
        finish = (output["meta_info"].get("finish_reason") or {}).get("type") or "stop"
        return TurnRecord(
            list(prompt_ids), [t for _, t, _ in pairs], finish, [float(lp) for lp, _, _ in pairs]
        )

    def _parse(self, text: str, messages: list[dict], tools: list[dict] | None) -> ParsedModelOutput:
        request = None
        reasoning = None
        if self.reasoning_parser or (tools and self.tool_parser):
            request = chat_request({"messages": [{"role": "user", "content": ""}], "tools": tools})
        if self.reasoning_parser:
            from vllm.reasoning import ReasoningParserManager

            parser = ReasoningParserManager.get_reasoning_parser(self.reasoning_parser)(self.tokenizer)
            reasoning, content = parser.extract_reasoning(text, request)
            text = content or ""
        if not tools:
            return ParsedModelOutput(text, reasoning)
        if not self.tool_parser:
            raise web.HTTPBadRequest(
                text="the request has tools but the adapter has no tool_parser: pass vLLM's parser name "
                "(--vllm-tool-call-parser, e.g. hermes for Qwen3)"
            )
        parser = tool_parser_class(self.tool_parser)(self.tokenizer)
        info = parser.extract_tool_calls(text, parser.adjust_request(request))
        if not info.tools_called:
            return ParsedModelOutput(text, reasoning)
        uses = [
            {"name": call.function.name, "input": _arguments(call.function.arguments)}
            for call in info.tool_calls
        ]
        return ParsedModelOutput(info.content or "", reasoning, uses)


def _arguments(arguments: Any) -> dict:
    """Tool-call arguments as a dict (a JSON string parsed; anything else kept under ``_raw_arguments``)."""
    if isinstance(arguments, dict):
        return arguments
    if not arguments:
        return {}
    try:
        parsed = json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        return {"_raw_arguments": str(arguments)}
    return parsed if isinstance(parsed, dict) else {"_raw_arguments": str(arguments)}


async def _close_http_session(app: web.Application) -> None:
    await close_session()


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True, "time": time.time()})
