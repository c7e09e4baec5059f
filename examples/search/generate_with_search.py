"""Search-R1-style rollout: the model searches a local BM25 index with ``<search>query</search>``, reads the passages
returned in ``<information>...</information>`` and answers with ``<answer>...</answer>``.

``--custom-generate-function-path examples.search.generate_with_search.generate``,
``--custom-rm-path examples.search.generate_with_search.reward``. Written as a slime plug-in is (slime's
``examples/search-r1``), to show the port: SGLang's ``/generate`` request through ``post`` from
:mod:`vime.rollout.sglang_compat` and the tokenizer from :class:`~vime.rollout.generate_state.GenerateState`. The
conversation is carried as token ids (what the model generated is what it sees next turn); the retrieved passages
are appended with loss mask 0.
"""

from __future__ import annotations

import re
import string
from functools import cache
from pathlib import Path
from typing import Any

from examples.search.bm25 import BM25
from vime.rollout.generate_state import GenerateState
from vime.rollout.sglang_compat import post
from vime.utils.types import Sample

CORPUS = Path(__file__).with_name("corpus.jsonl")
MAX_TURNS = 3
TOP_K = 2
FORMAT_SCORE = 0.1  # reward for a well-formed answer that is wrong
PROMPT = (
    "Answer the question. You may search a knowledge base: write <search>your query</search> and the results "
    "come back between <information> and </information>. Search as often as you need, then give the final "
    "answer as <answer>a few words</answer>.\nQuestion: {question}\n"
)
_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


@cache
def retriever() -> BM25:
    return BM25.from_jsonl(CORPUS)


def search(query: str) -> str:
    """The top passages for ``query``, formatted for the model."""
    hits = retriever().search(query, TOP_K)
    return "\n".join(f"Doc {i + 1} ({d['title']}): {d['text']}" for i, d in enumerate(hits)) or "No results."


def next_observation(turn_text: str) -> tuple[str | None, str | None]:
    """(text to append for the model, final answer): search results, or the answer, or a format reminder."""
    match = _ACTION.search(turn_text)
    if match is None:
        return (
            "\nMy previous action is invalid. To search, put the query between <search> and </search>; to answer, "
            "put the answer between <answer> and </answer>.\n",
            None,
        )
    action, content = match.group(1), match.group(2).strip()
    if action == "answer":
        return None, content
    return f"\n\n<information>{search(content)}</information>\n\n", None


async def generate(
    args, sample: Sample, sampling_params: dict[str, Any], first_turn_fields: dict[str, Any] | None = None
) -> Sample:
    """Up to ``MAX_TURNS`` model turns, each stopped at ``</search>`` or ``</answer>``. ``first_turn_fields`` are
    extra sampling fields for the first turn (e.g. ``regex`` to make the model start with a search)."""
    if args.apply_chat_template:
        raise ValueError(
            "examples.search writes the prompt and applies the chat template itself; drop --apply-chat-template"
        )
    state = GenerateState(args)
    url = f"http://{args.vllm_router_ip}:{args.vllm_router_port}/generate"
    messages = [{"role": "user", "content": PROMPT.format(question=sample.prompt)}]
    prompt_ids = state.tokenizer.apply_chat_template(
        messages,
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
        **args.apply_chat_template_kwargs,
    )
    sample.tokens, sample.response, sample.response_length = list(prompt_ids), "", 0
    sample.loss_mask = sample.rollout_log_probs = None
    stops = list(dict.fromkeys([*(sampling_params.get("stop") or []), "</search>", "</answer>"]))
    params = {**sampling_params, "stop": stops}
    searches, answer = 0, None
    for turn in range(MAX_TURNS):
        turn_params = {**params, **(first_turn_fields or {})} if turn == 0 else params
        budget = sampling_params["max_tokens"] - sample.response_length
        if args.rollout_max_context_len is not None:  # prompt + response must fit the context
            budget = min(budget, args.rollout_max_context_len - len(sample.tokens))
        if budget <= 0:
            sample.status = Sample.Status.TRUNCATED
            break
        turn_params["max_tokens"] = budget
        payload = {"input_ids": sample.tokens, "sampling_params": turn_params, "return_logprob": True}
        output = await post(url, payload)
        meta = output["meta_info"]
        sample.append_response_tokens(
            args,
            tokens=[token for _, token, _ in meta["output_token_logprobs"]],
            log_probs=[log_prob for log_prob, _, _ in meta["output_token_logprobs"]],
            meta_info=meta,
            text=output["text"],
        )
        if meta["finish_reason"]["type"] != "stop":  # truncated, or aborted (the batch is full)
            break
        observation, answer = next_observation(output["text"])
        if observation is None:
            break
        searches += "<information>" in observation
        observation_ids = state.tokenizer(observation, add_special_tokens=False)["input_ids"]
        sample.append_response_tokens(args, tokens=observation_ids, trainable=False, text=observation)
    sample.metadata = {**sample.metadata, "searches": searches, "answer": answer}
    return sample


def normalize(text: str) -> str:
    """Lower-case, no punctuation, no articles, single spaces (SQuAD-style exact match)."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


async def reward(args, sample: Sample, **kwargs) -> float:
    """1.0 for an exact match with one of the label's answers, ``FORMAT_SCORE`` for another answer, else 0.0."""
    answer = sample.metadata.get("answer")
    if answer is None:
        return 0.0
    golds = sample.label if isinstance(sample.label, list) else [sample.label]
    return 1.0 if normalize(answer) in {normalize(str(g)) for g in golds} else FORMAT_SCORE
