"""On-policy distillation (OPD) with a teacher served by vLLM (slime's ``slime.rollout.on_policy_distillation``).

The student samples responses as usual; for each one the teacher server scores the student's own tokens, and the
trainer adds ``-opd_kl_coef * (logp_student - logp_teacher)`` to every token's advantage (a per-token reverse-KL
penalty, ``--use-opd``). The teacher is any vLLM OpenAI server with the student's tokenizer: one vime serves as a
``--vllm-config`` model with ``role: teacher``, or one the user started
(``python -m vllm.entrypoints.openai.api_server --model TEACHER ...``) and names with ``--rm-url``::

    --use-opd --opd-type vllm [--rm-url http://TEACHER_HOST:PORT]
    --custom-rm-path vime.rollout.on_policy_distillation.reward_func
    --custom-reward-post-process-path vime.rollout.on_policy_distillation.post_process_rewards

:func:`reward_func` asks the teacher for the log-probs of prompt + response (``/v1/completions`` with the token ids
as the prompt and ``prompt_logprobs: 0``; vLLM needs ``max_tokens >= 1``, so the teacher also samples one token,
which is dropped), keeps the response's part in ``sample.teacher_log_probs`` and returns 0.0: pure distillation,
as slime. To mix in a task reward, write your own reward that awaits :func:`fetch_teacher_log_probs` and returns
the task's score (and drop the post-process, which zeroes the rewards as slime's does).

Unlike slime, the log-probs land on the sample in the reward function rather than in the post-process (slime's
reward is the teacher's whole response, which vime's reward metrics could not average); the post-process checks
that every sample has them and returns slime's all-zero rewards. ``--opd-type trainer`` (``--opd-teacher-load``)
instead runs the teacher inside the training backend and needs none of this.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

from vime.rollout.vllm_generate import get_model_url
from vime.utils.http_utils import post
from vime.utils.run_context import run_context_of
from vime.utils.types import Sample, Status

COMPLETIONS_PATH = "/v1/completions"


def teacher_completions_url(rm_url: str | None) -> str:
    """The teacher's ``/v1/completions`` URL from ``--rm-url``: a server address (``http://host:port``), that URL
    itself, or slime's ``http://host:port/generate`` (SGLang's route, replaced by vLLM's)."""
    if not rm_url:
        raise ValueError(
            "on-policy distillation with a teacher server needs --rm-url (the teacher vLLM server, e.g. "
            "http://127.0.0.1:30000) or a --vllm-config model with role: teacher"
        )
    parts = urlsplit(rm_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--rm-url {rm_url!r}: expected http://HOST:PORT of the teacher vLLM server")
    path = parts.path.rstrip("/")
    if path.endswith("/generate"):  # a slime script's SGLang URL
        path = path.removesuffix("/generate")
    if not path.endswith(COMPLETIONS_PATH):
        path += COMPLETIONS_PATH
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def teacher_request(tokens: list[int]) -> dict[str, Any]:
    """The ``/v1/completions`` body that scores ``tokens`` under the teacher (each token's log-prob given the
    tokens before it, of the unscaled logits)."""
    return {"prompt": tokens, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}


def response_log_probs(choice: dict[str, Any], tokens: list[int], response_length: int) -> list[float]:
    """The log-probs of the last ``response_length`` of ``tokens`` in a completion choice's ``prompt_logprobs``
    (one entry per prompt token, the first None, each a ``{token_id: {"logprob": ...}}`` dict)."""
    entries = choice.get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != len(tokens):
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise ValueError(f"teacher returned {got} prompt log-probs for {len(tokens)} tokens")
    start = len(tokens) - response_length
    if start < 1:
        raise ValueError("a sample needs at least one prompt token before its response to be scored")
    log_probs = []
    for position in range(start, len(tokens)):
        entry = entries[position] or {}
        scored = entry.get(str(tokens[position]))
        if scored is None:
            raise ValueError(
                f"teacher's prompt log-probs at position {position} do not cover token {tokens[position]}: does "
                "the teacher use the student's tokenizer?"
            )
        log_probs.append(float(scored["logprob"]))
    return log_probs


def teacher_url(args: Any) -> str:
    """The teacher's ``/v1/completions``: ``--rm-url``, else the router of the ``--vllm-config`` model with role
    ``teacher`` (``args``: the view a reward function is handed, which carries the run's routers)."""
    if args.rm_url:
        return teacher_completions_url(args.rm_url)
    teachers = [name for name, role in run_context_of(args).model_roles.items() if role == "teacher"]
    if not teachers:
        return teacher_completions_url(None)  # raises, naming both ways to give a teacher
    if len(teachers) > 1:
        raise ValueError(f"--vllm-config serves several teachers {teachers}; pick one with --rm-url")
    return get_model_url(args, teachers[0], COMPLETIONS_PATH)


async def fetch_teacher_log_probs(args: Any, sample: Sample) -> list[float]:
    """The teacher's log-probs of ``sample``'s response tokens (len ``response_length``), from ``--rm-url`` or the
    ``--vllm-config`` teacher."""
    choice = (await post(teacher_url(args), teacher_request(sample.tokens)))["choices"][0]
    return response_log_probs(choice, sample.tokens, sample.response_length)


async def reward_func(args: Any, sample: Sample, **kwargs: Any) -> float:
    """``--custom-rm-path``: set ``sample.teacher_log_probs`` from the teacher server; the reward is 0.0 (the
    learning signal is the OPD term)."""
    sample.teacher_log_probs = await fetch_teacher_log_probs(args, sample)
    return 0.0


def post_process_rewards(args: Any, samples: list[Sample], **kwargs: Any) -> tuple[list[float], list[float]]:
    """``--custom-reward-post-process-path``: check that every trainable sample carries its teacher log-probs;
    return slime's ``(raw_rewards, rewards)``, both all 0.0 for pure distillation."""
    for sample in samples:
        trainable = sample.status != Status.FAILED and not sample.remove_sample
        if trainable and (
            sample.teacher_log_probs is None or len(sample.teacher_log_probs) != sample.response_length
        ):
            have = "none" if sample.teacher_log_probs is None else f"{len(sample.teacher_log_probs)}"
            raise ValueError(
                f"sample {sample.index}: {have} teacher log-probs for {sample.response_length} response tokens; "
                "reward with --custom-rm-path vime.rollout.on_policy_distillation.reward_func"
            )
    zeros = [0.0] * len(samples)
    return zeros, list(zeros)
