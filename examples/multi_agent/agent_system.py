"""A solver -> rewriter -> selector agent system whose every agent call is a training sample (slime's
``examples/multi_agent``).

``--custom-generate-function-path examples.multi_agent.agent_system.generate`` with ``--rm-type gsm8k`` (or any
``--rm-type`` that scores a final answer). For each prompt, ``NUM_PARALLEL`` solvers answer independently,
``NUM_PARALLEL`` rewriters each improve on all the solutions, and a selector picks the best rewrite. The generate
function returns all ``2 * NUM_PARALLEL + 1`` agent samples; they share the prompt's ``rollout_id`` (one trajectory,
as slime) and carry their role in ``metadata["agent"]``.

Rewards, set here (so the rollout does not reward them again): solvers and rewriters by the task reward of their
own answer; the selector by the reward of the rewrite it picked (0 if its pick cannot be read). Every reward is then
scaled by ``CORRECT_WEIGHT`` when the selected answer is right and by ``INCORRECT_WEIGHT`` otherwise, so the whole
team shares the outcome. Each call is an ordinary vime request (:func:`vime.rollout.vllm_rollout.generate`).
"""

from __future__ import annotations

import asyncio
import copy
import re
from typing import Any

from vime.rollout.generate_state import GenerateState
from vime.rollout.rm_hub import async_rm
from vime.rollout.vllm_rollout import generate as generate_one
from vime.utils.types import Sample, Status

NUM_PARALLEL = 2
CORRECT_WEIGHT, INCORRECT_WEIGHT = 1.2, 0.8
SOLVER = "Solve the problem step by step and end with 'The answer is <number>.'\n\nProblem: {problem}"
REWRITER = (
    "Problem: {problem}\n\n{solutions}\n\nThe solutions above may contain mistakes. Write one improved, correct "
    "solution and end with 'The answer is <number>.'"
)
SELECTOR = "Problem: {problem}\n\n{solutions}\n\nWhich solution is correct? Reply with 'Judgment: <solution number>'."
_JUDGMENT = re.compile(r"Judgment:\s*(\d+)")


def numbered(solutions: list[str]) -> str:
    return "\n\n".join(f"Solution {i + 1}:\n{text}" for i, text in enumerate(solutions))


AGENTS_PER_PROMPT = 2 * NUM_PARALLEL + 1


def check_args(args) -> None:
    if args.apply_chat_template:
        raise ValueError(
            "examples.multi_agent writes each agent's prompt and applies the chat template itself; drop "
            "--apply-chat-template so the data's question reaches it as plain text"
        )


async def ask(
    args, sample: Sample, slot: int, role: str, prompt: str, sampling_params: dict[str, Any]
) -> Sample:
    """Agent call number ``slot`` for ``sample``: a new sample for ``prompt`` (same label, group and trajectory),
    with its own index (engines seeded per sample index would otherwise repeat one answer)."""
    tokenizer = GenerateState(args).tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        tokenize=False,
        add_generation_prompt=True,
        **(args.apply_chat_template_kwargs or {}),
    )
    agent = Sample(
        group_index=sample.group_index,
        index=sample.index * AGENTS_PER_PROMPT + slot,
        prompt=text,
        tokens=tokenizer(text, add_special_tokens=False)["input_ids"],
        label=sample.label,
        metadata={**copy.deepcopy(sample.metadata), "agent": role},
        rollout_id=sample.index,  # one trajectory: the prompt's
    )
    return await generate_one(args, agent, dict(sampling_params))


async def generate(args, sample: Sample, sampling_params: dict[str, Any]) -> list[Sample] | Sample:
    """Run the agent system on one prompt; all its agent samples, rewarded (or the prompt itself, ABORTED, when
    the rollout aborts it: the prompt goes back to the data buffer)."""
    check_args(args)
    problem = sample.prompt
    solver_prompt = SOLVER.format(problem=problem)
    solvers = await asyncio.gather(
        *(ask(args, sample, k, "solver", solver_prompt, sampling_params) for k in range(NUM_PARALLEL))
    )
    rewriter_prompt = REWRITER.format(problem=problem, solutions=numbered([s.response for s in solvers]))
    rewriters = await asyncio.gather(
        *(
            ask(args, sample, NUM_PARALLEL + k, "rewriter", rewriter_prompt, sampling_params)
            for k in range(NUM_PARALLEL)
        )
    )
    selector_prompt = SELECTOR.format(problem=problem, solutions=numbered([s.response for s in rewriters]))
    selector = await ask(args, sample, 2 * NUM_PARALLEL, "selector", selector_prompt, sampling_params)
    agents = [*solvers, *rewriters, selector]
    if any(a.status == Status.ABORTED for a in agents):
        sample.status = Status.ABORTED
        return sample
    for agent in [*solvers, *rewriters]:
        agent.reward = await async_rm(args, agent) if agent.status != Status.FAILED else 0.0
    picked = _JUDGMENT.findall(selector.response)
    choice = int(picked[-1]) - 1 if picked else -1
    selector.reward = rewriters[choice].reward if 0 <= choice < len(rewriters) else 0.0
    selector.metadata["selected"] = choice
    weight = CORRECT_WEIGHT if selector.reward == 1.0 else INCORRECT_WEIGHT
    for agent in agents:
        agent.reward *= weight
    return agents
