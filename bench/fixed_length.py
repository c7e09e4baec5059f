"""A rollout function for benchmarks: vime's default rollout with EOS ignored, so every response has exactly
``--rollout-max-response-len`` tokens and the work per step is known (``--rollout-function-path
bench.fixed_length.generate_rollout``, with the repository root on ``PYTHONPATH``)."""

from __future__ import annotations

import os
import random

from vime.rollout.vllm_rollout import generate, sampling_params_from_args, train_rollout
from vime.rollout.vllm_rollout import generate_rollout as default_rollout
from vime.utils.async_utils import run


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False):
    if evaluation:
        return default_rollout(args, rollout_id, data_source, evaluation=True)
    params = sampling_params_from_args(args) | {"ignore_eos": True}
    return run(train_rollout(args, rollout_id, data_source, params))


async def generate_drawn_length(args, sample, sampling_params):
    """``--custom-generate-function-path`` for a response-length distribution instead of one length: each sample
    generates exactly ``n`` tokens (EOS ignored), ``n`` drawn uniformly from ``[mean/2, 3·mean/2]`` (capped at
    ``--rollout-max-response-len``) by a generator seeded with the sample index, where ``mean`` is
    ``$VIME_BENCH_MEAN_RESPONSE_LEN``; so the work per step is known and the same in every run."""
    mean = int(os.environ["VIME_BENCH_MEAN_RESPONSE_LEN"])
    length = random.Random(sample.index).randint(max(mean // 2, 1), mean + mean // 2)
    params = sampling_params | {"ignore_eos": True, "max_tokens": min(length, sampling_params["max_tokens"])}
    return await generate(args, sample, params)


async def last_token_parity(args, sample, **kwargs) -> float:
    """``--custom-rm-path`` for benchmarks of random-init models, whose responses never match a label: 1 when the
    response's last token id is odd, else 0. About half the samples of a group score 1, so GRPO's advantages (and the
    policy gradient) are not all zero, and the reward depends only on the sample."""
    return float(sample.tokens[-1] % 2) if sample.response_length else 0.0
