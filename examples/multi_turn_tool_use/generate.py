"""Multi-turn tool use: the model may call a ``python`` tool (run in a sandboxed subprocess) before it answers.

``--custom-generate-function-path examples.multi_turn_tool_use.generate.generate`` and
``--custom-rm-path examples.multi_turn_tool_use.generate.reward``. Each sample is one conversation, talked through
vime's :class:`~vime.rollout.chat_recorder.ChatRecorder`: the model's turns train (loss mask 1, with the engine's
log-probs), the tool results and the chat template's glue between turns do not (loss mask 0). Tool calls are parsed
by vLLM's parser named by ``--vllm-tool-call-parser`` (``hermes`` for Qwen3).
"""

from __future__ import annotations

import json
from typing import Any

from examples.multi_turn_tool_use.sandbox import run_python
from vime.rollout.chat_recorder import ChatRecorder, GenerationStopped
from vime.rollout.rm_hub.gsm8k import compute_gsm8k_reward
from vime.utils.types import Sample, Status

MAX_TURNS = 4
TOOL_TIMEOUT_S = 5.0
SYSTEM_PROMPT = (
    "Solve the math problem. You may call the python tool to compute; it returns what the code prints. "
    "End your final reply with 'The answer is <number>.'"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run a Python 3 snippet and return its printed output (5 s limit, no network).",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The code; print the result."}},
                "required": ["code"],
            },
        },
    }
]


async def call_tool(call: dict[str, Any]) -> str:
    """Run one tool call; a malformed call gets an error message back (the model can correct itself)."""
    name = call["function"]["name"]
    if name != "python":
        return f"Error: unknown tool {name!r}; the only tool is python"
    try:
        code = json.loads(call["function"]["arguments"])["code"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return 'Error: the arguments must be a JSON object {"code": "..."}'
    return await run_python(code, timeout=TOOL_TIMEOUT_S)


async def generate(
    args, sample: Sample, sampling_params: dict[str, Any], first_turn_fields: dict[str, Any] | None = None
) -> Sample:
    """One conversation of up to ``MAX_TURNS`` model turns. ``first_turn_fields`` are extra request fields for
    the first turn (e.g. ``structured_outputs`` to make the model start with a tool call)."""
    if args.apply_chat_template:
        raise ValueError(
            "examples.multi_turn_tool_use builds the conversation itself (the chat template is applied to it on "
            "every turn); drop --apply-chat-template so the data's question reaches it as plain text"
        )
    recorder = ChatRecorder(args, sample, sampling_params)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": sample.prompt},
    ]
    tool_calls = 0
    try:
        for turn in range(MAX_TURNS):
            fields = first_turn_fields if turn == 0 and first_turn_fields else {}
            choice = (await recorder.chat(messages, tools=TOOLS, **fields))["choices"][0]
            messages.append(choice["message"])
            if choice["finish_reason"] != "tool_calls":
                break
            for call in choice["message"]["tool_calls"]:
                tool_calls += 1
                output = await call_tool(call)
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "name": "python", "content": output}
                )
        else:
            sample.status = Status.TRUNCATED  # still calling tools after MAX_TURNS turns
    except GenerationStopped:
        return sample  # aborted (the batch is full) or refused by the engine: the status says which
    sample.metadata = {
        **sample.metadata,
        "tool_calls": tool_calls,
        "final_reply": messages[-1].get("content"),
    }
    return sample


async def reward(args, sample: Sample, **kwargs) -> float:
    """1.0 when the final reply's answer matches the GSM8K label, else 0.0."""
    return compute_gsm8k_reward(sample.metadata.get("final_reply") or "", sample.label)
