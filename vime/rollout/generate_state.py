"""What a custom generate function needs besides ``args``: slime's ``GenerateState`` under vime.

``from slime.rollout.sglang_rollout import GenerateState`` becomes ``from vime.rollout.vllm_rollout import
GenerateState`` (also importable from here); ``GenerateState(args)`` inside a generate function returns the rollout's
shared state::

    state = GenerateState(args)
    prompt_ids = state.tokenizer(text, add_special_tokens=False)["input_ids"]
    async with state.semaphore:      # bounds how many samples run their (multi-turn) generation at once
        ...
    if state.aborted: ...            # the rollout is aborting in-flight requests (its batch is full)

``state.sampling_params`` are vime's defaults from the ``--rollout-*`` flags under vLLM's names (``max_tokens``
where slime's have SGLang's ``max_new_tokens``), readable under SGLang's names too
(:class:`~vime.utils.sglang_compat.SamplingParams`); a generate function receives its own copy as its third
argument. ``state.processor`` is the checkpoint's multimodal processor, ``None`` for the text models vime trains.
"""

from __future__ import annotations

import asyncio
import functools

from vime.rollout.vllm_generate import RolloutContext, get_context, sampling_params_from_args
from vime.utils import processing_utils
from vime.utils.sglang_compat import SamplingParams


@functools.cache
def load_tokenizer(path: str):
    """The Hugging Face tokenizer of ``path``, loaded once per process."""
    return processing_utils.load_tokenizer(path)


@functools.cache
def load_processor(path: str):
    """The multimodal processor of ``path`` (``None`` for a text model), loaded once per process."""
    return processing_utils.load_processor(path)


class GenerateState:
    """The tokenizer, default sampling parameters, a concurrency bound and the abort flag of the rollout that runs
    this generate function; one per router and event loop (``GenerateState(args)`` returns the same object)."""

    _states: dict[tuple, GenerateState] = {}

    def __new__(cls, args) -> GenerateState:
        key = (args.vllm_router_ip, args.vllm_router_port, id(asyncio.get_running_loop()))
        state = cls._states.get(key)
        if state is None:
            state = cls._states[key] = super().__new__(cls)
            state._init(args, get_context(args))
        return state

    def _init(self, args, context: RolloutContext) -> None:
        self.args = args
        self.tokenizer = load_tokenizer(args.hf_checkpoint)
        self.processor = load_processor(args.hf_checkpoint)
        # A bound on whole generate calls (slime holds it around each one); requests themselves are bounded by
        # the rollout's own limit, so holding this while generating cannot deadlock.
        self.semaphore = asyncio.Semaphore(args.rollout_concurrency * max(1, len(context.engine_urls)))
        self._context = context

    @property
    def sampling_params(self) -> SamplingParams:
        """A fresh copy of the ``--rollout-*`` sampling fields (vLLM names, SGLang's as aliases)."""
        return SamplingParams(sampling_params_from_args(self.args))

    @property
    def aborted(self) -> bool:
        """Whether the rollout is aborting its in-flight requests (a generate function should stop early)."""
        return self._context.aborting

    @property
    def router_url(self) -> str:
        """``http://IP:PORT`` of the router (requests go there)."""
        return self._context.router_url
