"""Generation through vllm-router, token-in/token-out: one sample, or a fresh group in one ``n``-sample request,
then the group's hooks and rewards (``--rollout-sample-hook-path``, ``--custom-rm-path`` / ``--rm-type``).

The building blocks of the default rollout (``vime.rollout.vllm_rollout``) and of eval (``eval_rollout``); a custom
generate function (``--custom-generate-function-path``) or rollout function uses :func:`generate` and
:func:`append_response` from here (also importable from ``vime.rollout.vllm_rollout``, with the request side,
:mod:`vime.rollout.router_client`).

Where requests go (the router), where abort calls go (the engines) and the weight version each request is stamped
with come from the run's :class:`~vime.utils.run_context.RunContext`: vime's functions here take it as the
keyword-only ``run_context``; called without it (from a plug-in with slime's signature) they find it behind the
``args`` the rollout gave the plug-in. ``--rollout-sample-seeds`` gives every request its own seed
(:func:`sample_seed`).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from vime.backends.vllm_utils import generate_api
from vime.backends.vllm_utils.routed_experts import apply_choice_routing
from vime.rollout.rm_hub import reward_samples
from vime.rollout.router_client import RolloutError, get_context, request
from vime.utils.misc import load_function
from vime.utils.run_context import RunContext, call_plugin, plugin_args, run_context_of
from vime.utils.sglang_compat import SamplingParams
from vime.utils.types import Sample, Status


def get_model_url(args, model: str, path: str = "/generate") -> str:
    """``http://HOST:PORT{path}`` of the router serving ``model``, a model name of ``--vllm-config`` (slime's
    ``get_model_url``, its default path SGLang's ``/generate``, which :func:`vime.utils.http_utils.post` answers
    through vLLM; without ``--vllm-config`` the policy is named ``policy``). Unlike slime's, an unknown name raises
    rather than falling back to the policy's router."""
    routers = run_context_of(args).model_routers
    if model not in routers:
        raise KeyError(
            f"no model {model!r} is served (models: {sorted(routers)}); name it in --vllm-config, or read the "
            "routers after the rollout manager started the engines"
        )
    host, port = routers[model]
    return f"http://{host}:{port}{path}"


def sampling_params_from_args(args, evaluation: bool = False) -> dict[str, Any]:
    """vLLM request fields for training (``--rollout-*``) or eval (``--eval-*``) sampling."""
    prefix = "eval" if evaluation else "rollout"
    params = {
        "temperature": getattr(args, f"{prefix}_temperature"),
        "top_p": getattr(args, f"{prefix}_top_p"),
        "top_k": getattr(args, f"{prefix}_top_k"),
        "max_tokens": getattr(args, f"{prefix}_max_response_len"),
    }
    if args.use_score_centering and not evaluation:  # the sampler's top-k head of every token, for the loss
        params["logprobs"] = args.score_centering_top_k
    return params | shared_params(args)


def shared_params(args) -> dict[str, Any]:
    """The request fields training and eval share: ``--rollout-stop`` / ``--rollout-stop-token-ids``, and the
    response text's special tokens, kept unless ``--rollout-skip-special-tokens`` (slime's default and SGLang's
    spacing: none added between special tokens)."""
    params: dict[str, Any] = {
        "skip_special_tokens": bool(getattr(args, "rollout_skip_special_tokens", False)),
        "spaces_between_special_tokens": False,
    }
    if args.rollout_stop:
        params["stop"] = args.rollout_stop
    if args.rollout_stop_token_ids:
        params["stop_token_ids"] = args.rollout_stop_token_ids
    return params


def sample_seed(args, sample: Sample) -> int:
    """A per-sample sampling seed: reproducible given ``--rollout-seed`` and the sample's running index."""
    return (args.rollout_seed * 1_000_003 + (sample.index or 0)) % (2**31 - 1)


def _completion_payload(args, prompt: list[int], sampling_params: dict[str, Any], max_tokens: int) -> dict:
    """The ``/v1/completions`` body for token-in/token-out generation with sampled-token log-probs (the
    per-token strings of the log-probs stay token-id placeholders: nothing here reads them, and decoding them
    one by one is a large part of the server's per-token cost)."""
    return {
        "logprobs": 0,  # the sampled token's; score centering's sampling params ask for the top-k as well
        **sampling_params,
        "model": args.hf_checkpoint,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }


def _apply_choice(args, sample: Sample, choice: dict[str, Any], weight_version: int) -> Sample:
    """Append one returned completion choice (tokens, log-probs, text, finish reason and, with
    ``--use-rollout-routing-replay``, the routed experts) to ``sample``, generated from ``weight_version`` on (by
    the versions its ``weight_versions`` spans name, with ``--flush-cache-interval``)."""
    token_ids = choice.get("token_ids") or []
    log_probs = (choice.get("logprobs") or {}).get("token_logprobs") or []
    if len(log_probs) != len(token_ids):
        raise RolloutError(f"engine returned {len(token_ids)} tokens but {len(log_probs)} log-probs")
    top_logprobs = (choice.get("logprobs") or {}).get("top_logprobs")
    if args.use_score_centering and top_logprobs is not None:  # before the tokens: a bad head appends nothing
        if len(top_logprobs) != len(token_ids):
            raise RolloutError(
                f"engine returned {len(token_ids)} tokens but {len(top_logprobs)} top log-probs"
            )
        append_sampler_heads(sample, top_logprobs, args.score_centering_top_k)
    spans, versions = generate_api.token_version_spans(choice, sample.response_length, weight_version)
    append_response(sample, token_ids, log_probs, choice.get("text") or "", trainable=True)
    sample.weight_version_spans += spans
    sample.weight_versions += versions
    sample.status = Status.from_finish_reason(choice.get("finish_reason"))
    has_routing = apply_choice_routing(sample, choice)
    if (
        getattr(args, "use_rollout_routing_replay", False)
        and not has_routing
        and sample.status != Status.ABORTED
    ):
        raise RolloutError(
            "--use-rollout-routing-replay: the engine returned no routed_experts for a finished request; engines "
            "must run with --enable-return-routed-experts (the rollout manager starts them so)"
        )
    return sample


def max_new_tokens(args, sample: Sample, sampling_params: dict[str, Any]) -> int:
    """Tokens ``sample`` may still generate: ``max_tokens`` minus its response so far, and no more than
    ``--rollout-max-context-len`` minus its length when that is set."""
    remaining = sampling_params["max_tokens"] - sample.response_length
    context = getattr(args, "rollout_max_context_len", None)
    return remaining if context is None else min(remaining, context - len(sample.tokens))


async def generate(
    args, sample: Sample, sampling_params: dict[str, Any], *, run_context: RunContext | None = None
) -> Sample:
    """Generate (or continue, for a partially generated sample) one response, token-in/token-out."""
    if sample.status in (Status.COMPLETED, Status.TRUNCATED, Status.FAILED):
        return sample
    remaining = max_new_tokens(args, sample, sampling_params)
    if remaining <= 0:
        sample.status = Status.TRUNCATED
        return sample
    payload = _completion_payload(args, sample.tokens, sampling_params, remaining)
    if getattr(args, "rollout_sample_seeds", False):
        payload["seed"] = sample_seed(args, sample)
    response = await request(get_context(args, run_context=run_context), payload, [sample])
    if response is None:
        return sample
    choices, version = response
    return _apply_choice(args, sample, choices[0], version)


def is_fresh_group(group: list[Sample]) -> bool:
    """Whether a group can be generated by one request with ``n`` samples: every sample still has only its
    prompt (the same for all), and the indices are consecutive (so vLLM's per-child seeds ``seed + i`` are
    the per-sample seeds)."""
    first = group[0]
    return all(
        s.status == Status.PENDING
        and s.response_length == 0
        and s.tokens == first.tokens
        and s.index == (first.index or 0) + i
        for i, s in enumerate(group)
    )


async def generate_fresh_group(
    args, group: list[Sample], sampling_params: dict[str, Any], *, run_context: RunContext | None = None
) -> list[Sample]:
    """Generate a whole group (:func:`is_fresh_group`) with one request of ``n = len(group)``: one HTTP round trip
    and one prefill for the group instead of one per sample, the same samples as :func:`generate` would draw."""
    remaining = max_new_tokens(args, group[0], sampling_params)
    if remaining <= 0:
        for sample in group:
            sample.status = Status.TRUNCATED
        return group
    payload = _completion_payload(args, group[0].tokens, sampling_params, remaining)
    payload["n"] = len(group)
    if getattr(args, "rollout_sample_seeds", False):
        payload["seed"] = sample_seed(args, group[0])
    response = await request(get_context(args, run_context=run_context), payload, group)
    if response is not None:
        choices, version = response
        if len(choices) != len(group):
            raise RolloutError(f"engine returned {len(choices)} choices for a request with n={len(group)}")
        for choice in choices:
            _apply_choice(args, group[choice["index"]], choice, version)
    return group


# vLLM's floor for a log-prob (its JSON has no -inf): the padding head of an environment token
_NO_PROBABILITY = -9999.0


def append_sampler_heads(sample: Sample, top_logprobs: list[dict | None], top_k: int) -> None:
    """Append the sampler's ``top_k`` most likely tokens and their log-probs for each new response token to
    ``sample.rollout_topk_token_ids`` / ``rollout_topk_log_probs`` (``--use-score-centering``). ``top_logprobs`` is
    vLLM's completion field: per token a dict ``{"token_id:N": logprob}`` of the top-k plus the sampled token."""
    ids, log_probs = [], []
    for step in top_logprobs:
        best = sorted((step or {}).items(), key=lambda item: -item[1])[:top_k]
        if len(best) < top_k or not all(key.startswith("token_id:") for key, _ in best):
            raise RolloutError(
                f"--use-score-centering: the engine returned {len(best)} top log-probs for a token, expected "
                f"{top_k} as token_id:N (--score-centering-top-k; engines run with --max-logprobs {top_k})"
            )
        ids.append([int(key.removeprefix("token_id:")) for key, _ in best])
        log_probs.append([float(value) for _, value in best])
    _extend_heads(sample, ids, log_probs)


def _extend_heads(sample: Sample, ids: list[list[int]], log_probs: list[list[float]]) -> None:
    if ids:  # a sample records heads once it has one, so a recorded list is never empty
        sample.rollout_topk_token_ids = (sample.rollout_topk_token_ids or []) + ids
        sample.rollout_topk_log_probs = (sample.rollout_topk_log_probs or []) + log_probs


def append_response(
    sample: Sample, token_ids: list[int], log_probs: list[float], text: str, trainable: bool
) -> None:
    """Append generated (``trainable``) or environment/tool tokens (masked out, log-prob 0) to a sample; a sample
    that records the sampler's heads (score centering) gets padding heads for environment tokens."""
    # environment tokens of a sample that records the sampler's heads: zero-probability heads, masked by the loss
    if not trainable and sample.rollout_topk_token_ids is not None:
        top_k = len(sample.rollout_topk_token_ids[0])
        padding = [list(range(top_k))] * len(token_ids)
        _extend_heads(sample, padding, [[_NO_PROBABILITY] * top_k] * len(token_ids))
    sample.append_response_tokens(
        tokens=token_ids, log_probs=log_probs if trainable else None, trainable=trainable, text=text
    )


def reset_to_prompt(sample: Sample) -> Sample:
    """Drop a sample's (partial) response so its prompt can be generated again from scratch."""
    sample.tokens = sample.tokens[: sample.prompt_length]
    sample.response, sample.response_length = "", 0
    sample.loss_mask = sample.rollout_log_probs = sample.reward = sample.rollout_routed_experts = None
    sample.rollout_topk_token_ids = sample.rollout_topk_log_probs = None
    sample.weight_versions, sample.weight_version_spans = [], []
    sample.status, sample.failure_reason = Status.PENDING, None
    return sample


async def generate_group(
    args,
    group: list[Sample],
    sampling_params: dict[str, Any],
    rollout_id: int | None = None,
    evaluation: bool = False,
    *,
    run_context: RunContext | None = None,
) -> list[Sample]:
    """Generate every sample of a group (one ``n``-sample request when the group is fresh and no custom generate
    function is set), then reward it (unless the group was aborted). A generate function that returns several
    samples for one (an agent's turns) has them all in the returned group."""
    run_context = run_context_of(args, run_context)
    custom = args.custom_generate_function_path or any(s.generate_function_path for s in group)
    if not custom and is_fresh_group(group):
        samples = await generate_fresh_group(args, group, dict(sampling_params), run_context=run_context)
        return await _rewarded(args, samples, rollout_id, evaluation, run_context=run_context)
    if getattr(args, "mask_offpolicy_in_partial_rollout", False):
        for sample in group:
            mask_previous_response(sample)
    outputs = await asyncio.gather(
        *(
            generate_one(args, sample, sampling_params, evaluation, run_context=run_context)
            for sample in group
        )
    )
    samples = [s for out in outputs for s in (out if isinstance(out, list) else [out])]
    return await _rewarded(args, samples, rollout_id, evaluation, run_context=run_context)


async def generate_one(
    args,
    sample: Sample,
    sampling_params: dict[str, Any],
    evaluation: bool = False,
    *,
    run_context: RunContext | None = None,
) -> Sample | list[Sample]:
    """One sample through its generate function: the sample's own ``generate_function_path`` (slime's per-dataset
    eval setting), else ``--custom-generate-function-path``, else :func:`generate`. The function gets its own copy
    of ``sampling_params`` (readable under SGLang's names too, :class:`~vime.utils.sglang_compat.SamplingParams`),
    and ``evaluation=`` if its signature takes it (as slime passes it); one with slime's signature gets the read-only
    view of ``args`` (:func:`~vime.utils.run_context.call_plugin`)."""
    path = sample.generate_function_path or args.custom_generate_function_path
    generate_fn = load_function(path, "--custom-generate-function-path") if path else generate
    kwargs = {"evaluation": evaluation} if "evaluation" in inspect.signature(generate_fn).parameters else {}
    params = SamplingParams(sampling_params)
    run_context = run_context_of(args, run_context)
    return await call_plugin(generate_fn, args, sample, params, run_context=run_context, **kwargs)


def mask_previous_response(sample: Sample) -> None:
    """``--mask-offpolicy-in-partial-rollout`` (slime): a partially generated sample that resumes under newer
    weights trains only on the tokens generated from now on; its earlier response tokens get loss mask 0."""
    if sample.response_length and sample.status in (Status.PENDING, Status.ABORTED):
        sample.loss_mask = [0] * sample.response_length


async def _rewarded(
    args,
    samples: list[Sample],
    rollout_id: int | None = None,
    evaluation: bool = False,
    reward: bool = True,
    *,
    run_context: RunContext,
) -> list[Sample]:
    """Reward the samples of a group, unless the group was aborted (it goes back to the buffer); first each
    ``--rollout-sample-hook-path`` hook (slime: ``hook(args, sample, *, rollout_id, evaluation)``, sync or async,
    returning a replacement Sample or None to keep the one it may have changed). As in slime, a sample whose reward
    a custom generate function already set (e.g. a multi-agent system scoring its agents) keeps it. ``reward=False``:
    the hooks only. Hooks and rewards are plug-ins: they get the plug-in view of ``args``."""
    if any(s.status == Status.ABORTED for s in samples):
        return samples
    args = plugin_args(args, run_context)
    for path in getattr(args, "rollout_sample_hook_path", None) or []:
        hook = load_function(path, "--rollout-sample-hook-path")
        for i, sample in enumerate(samples):
            out = hook(args, sample, rollout_id=rollout_id, evaluation=evaluation)
            if inspect.isawaitable(out):
                out = await out
            samples[i] = out if out is not None else sample
    if reward:
        await reward_samples(args, [s for s in samples if s.reward is None])
    return samples


async def generate_and_rm(
    args,
    sample: Sample,
    sampling_params: dict[str, Any],
    evaluation: bool = False,
    *,
    run_context: RunContext | None = None,
) -> Sample | list[Sample]:
    """slime's per-sample step (``sglang_rollout.generate_and_rm``): generate one sample with its generate function
    (:func:`generate_one`) and reward what it returns (one sample or several), except with ``--group-rm`` (the group
    is rewarded together). A sample already COMPLETED or TRUNCATED comes back as it is; while the rollout aborts,
    a sample is marked ABORTED without a request."""
    if sample.status in (Status.COMPLETED, Status.TRUNCATED):
        return sample
    run_context = run_context_of(args, run_context)
    if get_context(args, run_context=run_context).aborting:
        sample.status = Status.ABORTED
        return sample
    if args.partial_rollout and args.mask_offpolicy_in_partial_rollout:
        mask_previous_response(sample)
    out = await generate_one(args, sample, sampling_params, evaluation, run_context=run_context)
    samples = out if isinstance(out, list) else [out]
    await _rewarded(args, samples, None, evaluation, reward=not args.group_rm, run_context=run_context)
    return out


async def generate_and_rm_group(
    args,
    group: list[Sample],
    sampling_params: dict[str, Any],
    evaluation: bool = False,
    *,
    run_context: RunContext | None = None,
) -> list[Sample]:
    """slime's per-group step (``sglang_rollout.generate_and_rm_group``): generate and reward a group
    (:func:`generate_group`); a group submitted while the rollout aborts comes back untouched."""
    run_context = run_context_of(args, run_context)
    if get_context(args, run_context=run_context).aborting:
        return group
    return await generate_group(args, group, sampling_params, evaluation=evaluation, run_context=run_context)
