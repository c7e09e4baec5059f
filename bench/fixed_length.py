"""A rollout function for benchmarks: vime's default rollout with EOS ignored, so every response has exactly
``--rollout-max-response-len`` tokens and the work per step is known (``--rollout-function-path
bench.fixed_length.generate_rollout``, with the repository root on ``PYTHONPATH``)."""

from __future__ import annotations

from vime.rollout.vllm_rollout import generate_rollout as default_rollout
from vime.rollout.vllm_rollout import sampling_params_from_args, train_rollout
from vime.utils.async_utils import run


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False):
    if evaluation:
        return default_rollout(args, rollout_id, data_source, evaluation=True)
    params = sampling_params_from_args(args) | {"ignore_eos": True}
    return run(train_rollout(args, rollout_id, data_source, params))
