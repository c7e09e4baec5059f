"""The examples' generate functions with their first model turn constrained by vLLM's structured outputs, so the
random-init tiny model makes the tool call / search the pipeline under test needs (loaded by import path)."""

from __future__ import annotations

import functools

from examples.agent_openai_api import generate as agent_openai_api
from examples.multi_turn_tool_use import generate as multi_turn_tool_use
from examples.search import generate_with_search as search

PYTHON_CALL = (
    "<tool_call>\n<function=python>\n<parameter=code>\nprint(3+4)\n</parameter>\n</function>\n</tool_call>"
)
CALCULATOR_CALL = (
    "<tool_call>\n<function=calculator>\n<parameter=expression>\n3+4\n</parameter>\n</function>\n</tool_call>"
)
SEARCH_QUERY = "<search>capital of france</search>"


def _regex(text: str) -> str:
    return "".join("\\" + ch if ch in "()+*?.[]{}|^$\\" else ch for ch in text)


tool_use_calls_python = functools.partial(
    multi_turn_tool_use.generate, first_turn_fields={"structured_outputs": {"regex": _regex(PYTHON_CALL)}}
)
agent_calls_calculator = functools.partial(
    agent_openai_api.generate,
    first_call_extra_body={"structured_outputs": {"regex": _regex(CALCULATOR_CALL)}},
)
# SGLang's own name for the constraint, translated by vime.rollout.sglang_compat
search_first = functools.partial(search.generate, first_turn_fields={"regex": _regex(SEARCH_QUERY)})
