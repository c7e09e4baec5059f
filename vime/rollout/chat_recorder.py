"""Chat completions with tool calls, recorded token-exactly into one training sample.

A custom generate function (or, through :mod:`vime.rollout.openai_server`, an agent written against the OpenAI SDK)
talks chat: messages in, an assistant message with ``tool_calls`` out. The sample records exactly the tokens the
engine saw and generated: the prompt, each generated turn (trained, with the engine's log-probs) and the tokens the
chat template puts between turns (tool results, the next turn's header: loss mask 0)::

    recorder = ChatRecorder(args, sample, sampling_params)
    messages = [{"role": "user", "content": question}]
    reply = await recorder.chat(messages, tools=TOOLS)          # OpenAI chat.completion body
    message = reply["choices"][0]["message"]                   # {"role", "content", "tool_calls"}
    messages += [message, {"role": "tool", "tool_call_id": ..., "content": output}]
    reply = await recorder.chat(messages, tools=TOOLS)          # the sample grows by the tool result + a turn

Why not vLLM's ``/v1/chat/completions``: it re-renders the whole history from text on every call, and the tokens
of a re-rendered reply need not be those the model generated (tokenizers merge differently; templates rewrite past
turns, e.g. drop reasoning), so the trajectory would not be one token sequence. Here vime renders the conversation
itself with each past assistant message replaced by exactly the tokens generated for it, and generates
token-in/token-out (:func:`vime.rollout.vllm_rollout.generate`: the rollout's concurrency bound, abort, weight
versions). Tool calls are parsed from the generated text by vLLM's own parser, named as for the server
(``--vllm-tool-call-parser hermes`` for Qwen3, or ``tool_parser=``); reasoning is left in the content.

The history must grow: each request holds the previous one's messages, the assistant messages as returned, then
new messages. Sampling follows the rollout (``--rollout-temperature`` ...: the trainer computes log-probs at that
temperature); a request may set ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``seed`` and vLLM's
``structured_outputs``.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from vime.rollout.generate_state import load_tokenizer
from vime.rollout.vllm_rollout import generate
from vime.utils.types import Sample, Status

logger = logging.getLogger(__name__)

_TURN = "<<vime-turn-{}>>"  # stands for a generated reply while the template renders the conversation
_TURN_RE = re.compile(r"<<vime-turn-(\d+)>>")
_HONOURED = {"max_tokens", "max_completion_tokens", "stop", "seed", "structured_outputs"}
_ROLLOUT_OWNED = {"temperature", "top_p", "top_k"}  # the trainer's log-probs assume the rollout's values
_ACCEPTED = {"messages", "model", "tools", "tool_choice", "n", "stream", "logprobs", "top_logprobs", "user"}


class ChatRequestError(ValueError):
    """The request cannot be served (bad field, a history that does not extend the trajectory...)."""


class GenerationStopped(RuntimeError):
    """The rollout aborted the sample (its batch is full) or the engine refused it; the sample's status says
    which. An agent should stop: the generate function returns the sample as it is."""


class ChatRecorder:
    """OpenAI-style chat completions for one sample, recorded token-exactly (see the module docstring)."""

    def __init__(self, args, sample: Sample, sampling_params: dict[str, Any], tool_parser: str | None = None):
        if sample.response_length:
            raise ChatRequestError(
                f"sample {sample.index} already has a {sample.response_length}-token response: a chat trajectory "
                "starts from the prompt (partial rollout is not supported here)"
            )
        self.args = args
        self.sample = sample
        self.sampling_params = dict(sampling_params)
        self.tokenizer = load_tokenizer(args.hf_checkpoint)
        self.tool_parser = tool_parser or getattr(args, "vllm_tool_call_parser", None)
        self.turns: list[list[int]] = []  # the generated token ids of each assistant reply, in order
        self._warned: set[str] = set()

    async def chat(self, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        """:meth:`create` with keyword fields."""
        return await self.create({"messages": messages, **fields})

    async def create(self, request: dict[str, Any]) -> dict[str, Any]:
        """Serve one ``chat.completions.create`` request body; returns the OpenAI response body."""
        params = self._sampling_fields(request)
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ChatRequestError("'messages' must be a non-empty list of chat messages")
        tools = request.get("tools") or None
        parse_tools = tools is not None and request.get("tool_choice", "auto") != "none"
        parser = self._parser(request) if parse_tools else None
        if parser is not None:
            adjusted = parser.adjust_request(chat_request(request))
            params["skip_special_tokens"] = adjusted.skip_special_tokens
        prompt = self.render(messages, tools)
        self._extend_trajectory(prompt)
        sample = self.sample
        text_start, token_start = len(sample.response), len(sample.tokens)
        sample.status = Status.PENDING
        params["max_tokens"] = sample.response_length + params["max_tokens"]
        await generate(self.args, sample, params)
        if sample.status in (Status.ABORTED, Status.FAILED):
            raise GenerationStopped(
                f"sample {sample.index} {sample.status.value}: {sample.failure_reason or ''}"
            )
        generated = sample.tokens[token_start:]
        self.turns.append(generated)
        text = sample.response[text_start:]
        message: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": []}
        if parser is not None:
            info = parser.extract_tool_calls(text, adjusted)
            if info.tools_called:
                message["content"] = info.content or None
                message["tool_calls"] = [call.model_dump() for call in info.tool_calls]
        finish = "length" if sample.status == Status.TRUNCATED else "stop"
        if message["tool_calls"]:
            finish = "tool_calls"
        else:
            del message["tool_calls"]
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        if request.get("logprobs"):
            log_probs = sample.rollout_log_probs[len(sample.rollout_log_probs) - len(generated) :]
            choice["logprobs"] = {
                "content": [
                    {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(generated, log_probs, strict=True)
                ]
            }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.get("model") or self.args.hf_checkpoint,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(generated),
                "total_tokens": len(prompt) + len(generated),
            },
        }

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        """The token ids of ``messages`` plus the next assistant header, each past assistant message being exactly
        the tokens generated for it."""
        replies = sum(1 for m in messages if m.get("role") == "assistant")
        if replies != len(self.turns):
            raise ChatRequestError(
                f"the request holds {replies} assistant messages but this trajectory generated {len(self.turns)} "
                "replies: send the whole conversation, every reply as it was returned, then the new messages"
            )
        standins, turn = [], 0
        for message in messages:
            if message.get("role") == "assistant":
                message = {"role": "assistant", "content": _TURN.format(turn)}
                turn += 1
            standins.append(message)
        text = self.tokenizer.apply_chat_template(
            standins,
            tools=tools,
            tokenize=False,
            add_generation_prompt=True,
            **(self.args.apply_chat_template_kwargs or {}),
        )
        pieces = _TURN_RE.split(text)  # text, turn index, text, turn index, ..., text
        if [int(i) for i in pieces[1::2]] != list(range(len(self.turns))):
            raise ChatRequestError(
                "the chat template dropped or reordered past assistant replies, so the conversation cannot be "
                "rendered around the generated tokens; use a template that renders every assistant message"
            )
        ids: list[int] = []
        special = set(self.tokenizer.all_special_ids)
        for k, piece in enumerate(pieces[::2]):
            piece_ids = self.tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
            reply_end = self.turns[k - 1][-1:] if k else []
            if piece_ids[:1] == reply_end and reply_end[0] in special:
                # the reply ended with the end-of-turn token that the template writes after it: keep one
                piece_ids = piece_ids[1:]
            ids += piece_ids
            if k < len(self.turns):
                ids += self.turns[k]
        return ids

    def _extend_trajectory(self, prompt: list[int]) -> None:
        """Make ``prompt`` the sample's tokens: the first prompt, or the trajectory so far plus new tokens that
        the template put after the last reply (masked out of the loss)."""
        sample = self.sample
        if not self.turns:
            sample.tokens = list(prompt)
            return
        known = len(sample.tokens)
        if prompt[:known] != sample.tokens:
            first = next(i for i, (a, b) in enumerate(zip(prompt, sample.tokens, strict=False)) if a != b)
            raise ChatRequestError(
                f"the conversation no longer starts with this trajectory's tokens (first difference at token "
                f"{first}): a request must extend the previous one (same earlier messages); start a new sample "
                "for a new conversation"
            )
        inserted = prompt[known:]
        sample.append_response_tokens(
            tokens=inserted, trainable=False, text=self.tokenizer.decode(inserted, skip_special_tokens=False)
        )

    def _sampling_fields(self, request: dict[str, Any]) -> dict[str, Any]:
        unknown = set(request) - _ACCEPTED - _HONOURED - _ROLLOUT_OWNED
        if unknown:
            raise ChatRequestError(f"unsupported chat request fields {sorted(unknown)}")
        if request.get("stream"):
            raise ChatRequestError("stream=true is not supported: vime answers whole replies")
        if request.get("top_logprobs"):
            raise ChatRequestError(
                "top_logprobs is not supported: replies carry the sampled tokens' log-probs only"
            )
        if request.get("n", 1) != 1:
            raise ChatRequestError(f"n={request['n']}: one reply per request (a trajectory is one sequence)")
        for key in _ROLLOUT_OWNED & set(request):
            if request[key] != self.sampling_params.get(key) and key not in self._warned:
                self._warned.add(key)
                logger.warning(
                    "chat request %s=%s ignored: the rollout samples with %s=%s (the trainer's log-probs assume it)",
                    key, request[key], key, self.sampling_params.get(key),
                )  # fmt: skip
        params = dict(self.sampling_params)
        limit = request.get("max_completion_tokens") or request.get("max_tokens")
        params["max_tokens"] = min(
            limit or self.args.rollout_max_response_len, self.args.rollout_max_response_len
        )
        params.update(
            {k: request[k] for k in ("stop", "seed", "structured_outputs") if request.get(k) is not None}
        )
        return params

    def _parser(self, request: dict[str, Any]):
        if not self.tool_parser:
            raise ChatRequestError(
                "the request has tools but no tool-call parser is set: pass --vllm-tool-call-parser NAME (as for "
                "vLLM's server, e.g. hermes for Qwen3) or ChatRecorder(..., tool_parser=NAME)"
            )
        if request.get("tool_choice", "auto") != "auto":
            raise ChatRequestError(
                f"tool_choice={request['tool_choice']!r}: only 'auto' and 'none' are supported (force a format with "
                "structured_outputs instead)"
            )
        return tool_parser_class(self.tool_parser)(self.tokenizer)


def tool_parser_class(name: str):
    """vLLM's tool parser class registered under ``name`` (``--tool-call-parser`` of its server)."""
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:  # vLLM before the parsers moved out of the OpenAI entrypoints
        from vllm.entrypoints.openai.tool_parsers import ToolParserManager
    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError as exc:
        raise ChatRequestError(f"unknown tool-call parser {name!r}: {exc}") from None


def chat_request(request: dict[str, Any]):
    """vLLM's ``ChatCompletionRequest`` for a request body (what its tool parsers read)."""
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    except ImportError:
        from vllm.entrypoints.openai.protocol import ChatCompletionRequest
    fields = {k: request[k] for k in ("messages", "tools", "tool_choice") if request.get(k) is not None}
    return ChatCompletionRequest(model=request.get("model") or "vime", **fields)
