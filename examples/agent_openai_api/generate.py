"""Train an OpenAI-SDK agent with vime: its chat calls go to a vime endpoint that records every token.

``--custom-generate-function-path examples.agent_openai_api.generate.generate``,
``--custom-rm-path examples.agent_openai_api.generate.reward``, ``--vllm-tool-call-parser NAME`` (``hermes`` for
Qwen3). For each sample, :func:`vime.rollout.openai_server.openai_endpoint` serves ``/v1/chat/completions`` on a
local port; the agent (:mod:`examples.agent_openai_api.agent`, unchanged OpenAI-SDK code) gets a client for it.
vime renders each request's conversation around the exact tokens generated so far and generates token-in/token-out,
so the sample holds the prompt, the model's turns (trained, with the engine's log-probs) and the tool results and
template tokens between them (loss mask 0) — exactly the sequence the engine saw.
"""

from __future__ import annotations

from typing import Any

import openai

from examples.agent_openai_api.agent import solve
from vime.rollout.openai_server import openai_endpoint
from vime.rollout.rm_hub.gsm8k import compute_gsm8k_reward
from vime.utils.types import Sample, Status


async def generate(
    args, sample: Sample, sampling_params: dict[str, Any], first_call_extra_body: dict[str, Any] | None = None
) -> Sample:
    """Run the agent on the sample's question; ``first_call_extra_body`` is passed to the agent's first request."""
    if args.apply_chat_template:
        raise ValueError(
            "examples.agent_openai_api: the agent sends chat messages and vime applies the chat template to them; "
            "drop --apply-chat-template so the data's question reaches the agent as plain text"
        )
    async with openai_endpoint(args, sample, sampling_params) as base_url:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="vime", max_retries=0)
        try:
            answer = await solve(client, sample.prompt, first_call_extra_body=first_call_extra_body)
        except openai.BadRequestError:
            if sample.status not in (Status.ABORTED, Status.FAILED):
                raise  # the agent sent something vime cannot serve: a bug to see, not a sample to skip
            answer = None  # the rollout aborted the sample or the engine refused it; its status says which
        finally:
            await client.close()
    sample.metadata = {**sample.metadata, "final_reply": answer}
    return sample


async def reward(args, sample: Sample, **kwargs) -> float:
    """1.0 when the agent's final reply has the GSM8K label's answer, else 0.0."""
    return compute_gsm8k_reward(sample.metadata.get("final_reply") or "", sample.label)
