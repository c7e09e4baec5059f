"""HTTP adapters for agent rollouts (slime's ``slime.agent.adapters``): an agent CLI speaks OpenAI Chat Completions
(:class:`OpenAIAdapter`) or Anthropic Messages (:class:`AnthropicAdapter`) to the adapter, which generates each turn
on the policy's engines and turns each session into training samples (:mod:`vime.agent.adapters.common`)."""

from vime.agent.adapters.anthropic import AnthropicAdapter
from vime.agent.adapters.common import BaseAdapter
from vime.agent.adapters.openai import OpenAIAdapter

__all__ = ["AnthropicAdapter", "BaseAdapter", "OpenAIAdapter"]
