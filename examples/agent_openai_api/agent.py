"""A plain OpenAI-SDK agent with a calculator tool: nothing here knows about vime.

It is the kind of agent code one already has (or gets from an agent framework): given an ``AsyncOpenAI`` client,
it loops over ``chat.completions.create`` calls, runs the tool calls the model makes and returns the final reply.
``examples/agent_openai_api/generate.py`` points such a client at vime, which trains on the conversation.
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

from openai import AsyncOpenAI

SYSTEM_PROMPT = (
    "You are a careful math assistant. Use the calculator tool for arithmetic. "
    "End your final reply with 'The answer is <number>.'"
)
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2"}},
            "required": ["expression"],
        },
    },
}
_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos,
}  # fmt: skip


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or an error message (no names, calls or huge powers)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported syntax: {ast.dump(node)[:40]}")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"Error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


async def solve(
    client: AsyncOpenAI,
    question: str,
    model: str = "policy",
    max_turns: int = 4,
    first_call_extra_body: dict[str, Any] | None = None,
) -> str | None:
    """Chat until the model answers without a tool call; its last reply (None if it never stopped calling tools).
    ``first_call_extra_body`` goes into the first request (server-specific fields, e.g. vLLM's
    ``structured_outputs``)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]
    for turn in range(max_turns):
        completion = await client.chat.completions.create(
            model=model,
            messages=messages,
            tools=[CALCULATOR],
            extra_body=first_call_extra_body if turn == 0 else None,
        )
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments)["expression"]
                result = calculate(expression)
            except (json.JSONDecodeError, KeyError, TypeError):
                result = 'Error: arguments must be {"expression": "..."}'
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
