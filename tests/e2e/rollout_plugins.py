"""Plug-ins the rollout e2e tests load by import path (as users load theirs)."""

from __future__ import annotations

import os
import time

from vime.rollout.filter_hub.base_types import DynamicFilterOutput
from vime.rollout.vllm_rollout import append_response, generate, generate_rollout
from vime.utils.types import Status

ODD_GROUP_TOKENS = 400


async def slow_odd_groups(args, sample, sampling_params):
    """Odd groups generate long (no EOS) in 10-token requests, even groups two tokens: odd ones are still in flight
    when the batch fills. Each chunk needs this client again, so a client starved of CPU (the engine busy-waits on
    every core of a 2-core machine) slows the odd groups as much as the even ones instead of letting the server
    finish 400 tokens while the even results wait to be read."""
    if sample.group_index % 2 == 0:
        sampling_params.update(max_tokens=2)
        return await generate(args, sample, sampling_params)
    sampling_params.update(ignore_eos=True)
    if sample.status == Status.ABORTED:  # a partial response resumed from the buffer
        sample.status = Status.PENDING
    while sample.status in (Status.PENDING, Status.TRUNCATED) and sample.response_length < ODD_GROUP_TOKENS:
        sample.status = Status.PENDING  # a finished chunk (TRUNCATED at its length) goes on
        sampling_params["max_tokens"] = min(sample.response_length + 10, ODD_GROUP_TOKENS)
        await generate(args, sample, sampling_params)
    return sample


def keep_even_groups(args, samples):
    """Keep only groups with an even group_index."""
    keep = samples[0].group_index % 2 == 0
    return DynamicFilterOutput(keep=keep, reason=None if keep else "odd_group")


def remove_first_sample(args, groups):
    """--rollout-sample-filter-path: the first sample of every group does not train."""
    for group in groups:
        group[0].remove_sample = True


SEEN_GROUPS: list[list[int]] = []


def record_all_groups(args, groups, data_source):
    """--rollout-all-samples-process-path: remember which groups finished (kept and filtered out)."""
    SEEN_GROUPS.append([group[0].group_index for group in groups])


async def two_turns_with_tool_output(args, sample, sampling_params):
    """Model turn, a fake tool's reply (masked out of the loss), then a second model turn."""
    sampling_params["max_tokens"] = 3
    sample = await generate(args, sample, sampling_params)
    tool_tokens = [5, 6, 7]
    append_response(sample, tool_tokens, [], "<tool>", trainable=False)
    sample.status = Status.PENDING
    sampling_params["max_tokens"] = sample.response_length + 3
    return await generate(args, sample, sampling_params)


def failing_rollout(args, rollout_id, data_source, evaluation=False):
    """A rollout function that breaks at rollout 1 (after a full step 0), as a user's buggy plug-in would."""
    if rollout_id == 1:
        raise RuntimeError("plug-in failure at rollout 1")
    return generate_rollout(args, rollout_id, data_source, evaluation)


def stall_at_rollout(args, rollout_id, data_source, evaluation=False):
    """The default rollout, except that rollout ``$VIME_TEST_STALL_AT`` never ends: a run to kill at a known point."""
    if not evaluation and str(rollout_id) == os.environ.get("VIME_TEST_STALL_AT"):
        time.sleep(3600)
    return generate_rollout(args, rollout_id, data_source, evaluation)


def stall_while_file(args, rollout_id, data_source, evaluation=False):
    """The default rollout, except that rollout ``$VIME_TEST_STALL_AT`` waits while the file ``$VIME_TEST_STALL_FILE``
    exists: a run to kill at a known point, and a resubmitted one that goes on (the environment is a Ray cluster's,
    the same for every run on it)."""
    if not evaluation and str(rollout_id) == os.environ.get("VIME_TEST_STALL_AT"):
        while os.path.exists(os.environ["VIME_TEST_STALL_FILE"]):
            time.sleep(0.2)
    return generate_rollout(args, rollout_id, data_source, evaluation)


IM_START_ID = 1  # the tiny model's <|im_start|>: a special token that does not end a response


async def force_im_start(args, sample, sampling_params):
    """Two tokens, both <|im_start|> (a logit bias forces them): the response text then shows or hides it
    (--rollout-skip-special-tokens)."""
    sampling_params.update(max_tokens=2, logit_bias={str(IM_START_ID): 100.0})
    return await generate(args, sample, sampling_params)


def record_weight_dir(args, version_dir, rollout_engines):
    """--custom-update-weight-post-write-path: note each version directory and the files in it when called."""
    files = sorted(os.listdir(version_dir))
    with open(os.path.join(os.path.dirname(version_dir), "post_write.log"), "a") as log:
        log.write(f"{os.path.basename(version_dir)} {len(rollout_engines)} {','.join(files)}\n")


async def judged_with_teacher(args, sample, **kwargs):
    """--custom-rm-path for the --vllm-config test: the teacher's log-probs for on-policy distillation (from the
    teacher model's router) and, as the reward, the judge model's probability of the response (from its router)."""
    from vime.rollout.on_policy_distillation import (
        fetch_teacher_log_probs,
        response_log_probs,
        teacher_request,
    )
    from vime.rollout.vllm_rollout import get_model_url
    from vime.utils.http_utils import post

    sample.teacher_log_probs = await fetch_teacher_log_probs(args, sample)
    judged = await post(get_model_url(args, "judge", "/v1/completions"), teacher_request(sample.tokens))
    log_probs = response_log_probs(judged["choices"][0], sample.tokens, sample.response_length)
    return float(sum(log_probs) / len(log_probs))
