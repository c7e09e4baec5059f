"""What a custom generate function needs besides ``args``: slime's ``GenerateState`` under vime.

``from slime.rollout.sglang_rollout import GenerateState`` becomes ``from vime.rollout.vllm_rollout import
GenerateState`` (also importable from here); ``GenerateState(args)`` inside a generate function returns the rollout's
shared state::

    state = GenerateState(args)
    prompt_ids = state.tokenizer(text, add_special_tokens=False)["input_ids"]
    async with state.semaphore:      # bounds how many samples run their (multi-turn) generation at once
        ...
    if state.aborted: ...            # the rollout is aborting in-flight requests (its batch is full)

A rollout function written like slime's ``generate_rollout_async`` submits groups with
``state.submit_generate_tasks(groups)`` (tasks in ``state.pendings``, counted by ``state.remaining_batch_size``),
stops the rest with :func:`abort` and calls ``state.reset()`` before the next rollout.

``state.sampling_params`` are vime's defaults from the ``--rollout-*`` flags under vLLM's names (``max_tokens``
where slime's have SGLang's ``max_new_tokens``), readable under SGLang's names too
(:class:`~vime.utils.sglang_compat.SamplingParams`); a generate function receives its own copy as its third
argument. ``state.processor`` is the checkpoint's multimodal processor, ``None`` for the text models vime trains.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

from vime.rollout.router_client import RolloutContext, get_context
from vime.rollout.vllm_generate import generate_and_rm_group, sampling_params_from_args
from vime.utils import processing_utils
from vime.utils.run_context import RunContext, run_context_of
from vime.utils.sglang_compat import SamplingParams
from vime.utils.types import Sample

logger = logging.getLogger(__name__)
# abort again this often until every submitted group is back (requests in transit start after an abort)
ABORT_RETRY_S = 0.2


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
    this generate function; one per run and event loop (``GenerateState(args)`` returns the same object). The run is
    ``run_context``, else the one behind the ``args`` the rollout handed the generate function."""

    _states: dict[tuple, GenerateState] = {}

    def __new__(cls, args, *, run_context: RunContext | None = None) -> GenerateState:
        run_context = run_context_of(args, run_context)
        key = (id(run_context), id(asyncio.get_running_loop()))
        state = cls._states.get(key)
        if state is None:
            state = cls._states[key] = super().__new__(cls)
            state._init(args, get_context(args, run_context=run_context))
        return state

    def _init(self, args, context: RolloutContext) -> None:
        self.args = args
        self.tokenizer = load_tokenizer(args.hf_checkpoint)
        self.processor = load_processor(args.hf_checkpoint)
        # A bound on whole generate calls (slime holds it around each one); requests themselves are bounded by
        # the rollout's own limit, so holding this while generating cannot deadlock.
        self.semaphore = asyncio.Semaphore(args.rollout_concurrency * max(1, len(context.engine_urls)))
        self._context = context
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Task] = set()

    def reset(self) -> None:
        """Forget submitted tasks and end an abort (slime's: before the next rollout or eval)."""
        self.remaining_batch_size = 0
        self.pendings = set()
        self._context.aborting = False

    def submit_generate_tasks(self, samples: list[list[Sample]]) -> None:
        """Start generating and rewarding each group (:func:`~vime.rollout.vllm_generate.generate_and_rm_group`,
        the rollout's sampling parameters) as a task in :attr:`pendings`; count them in :attr:`remaining_batch_size`."""
        for group in samples:
            task = generate_and_rm_group(
                self.args, group, self.sampling_params, run_context=self._context.run
            )
            self.pendings.add(asyncio.create_task(task))
        self.remaining_batch_size += len(samples)

    @contextlib.contextmanager
    def dp_rank_context(self):
        """slime's pick of an SGLang data-parallel rank; a vLLM engine balances its own ranks: always 0."""
        yield 0

    @property
    def sampling_params(self) -> SamplingParams:
        """A fresh copy of the ``--rollout-*`` sampling fields (vLLM names, SGLang's as aliases)."""
        return SamplingParams(sampling_params_from_args(self.args))

    @property
    def aborted(self) -> bool:
        """Whether the rollout is aborting its in-flight requests (a generate function should stop early)."""
        return self._context.aborting

    @aborted.setter
    def aborted(self, value: bool) -> None:
        self._context.aborting = value

    @property
    def router_url(self) -> str:
        """``http://IP:PORT`` of the router (requests go there)."""
        return self._context.router_url


async def abort(args, rollout_id: int) -> list[list[Sample]]:
    """Stop the groups :meth:`GenerateState.submit_generate_tasks` left running (slime's ``abort``): abort every
    engine's requests until each pending task has returned, and give back, with ``--partial-rollout``, the groups
    that hold a partial response (``metadata["start_rollout_id"]`` set to ``rollout_id`` where it was not);
    otherwise none. The state stays aborted until :meth:`GenerateState.reset`."""
    state = GenerateState(args)
    state.aborted = True
    returned = []
    while state.pendings:
        await state._context.abort_all()
        done, state.pendings = await asyncio.wait(state.pendings, timeout=ABORT_RETRY_S)
        if not args.partial_rollout:
            continue
        for task in done:
            group = task.result()
            for sample in group:
                if sample.response and "start_rollout_id" not in sample.metadata:
                    sample.metadata["start_rollout_id"] = rollout_id
            returned.append(group)
    if args.partial_rollout:
        logger.info("abort: %d partial groups back to the data buffer", len(returned))
    return returned
