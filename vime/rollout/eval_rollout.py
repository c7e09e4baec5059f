"""Evaluation through the default rollout path: every eval dataset, its own sampling and reward settings."""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import functools
import json

from transformers import AutoTokenizer

from vime.rollout.eval_metrics import compute_eval_metrics
from vime.rollout.vllm_generate import generate_group, shared_params
from vime.utils.data import PromptDataset, load_prompt_dataset
from vime.utils.eval_config import EvalDatasetConfig, load_eval_configs
from vime.utils.run_context import RunContext, configuration, run_context_of
from vime.utils.types import RolloutFnEvalOutput, Sample, Status


@functools.cache
def _tokenizer(path: str):
    return AutoTokenizer.from_pretrained(path)


_datasets: dict[tuple, PromptDataset] = {}


def _dataset(args, config: EvalDatasetConfig) -> PromptDataset:
    """The eval dataset, loaded once per process (evals repeat every --eval-interval rollouts)."""
    key = (
        args.hf_checkpoint,
        json.dumps(args.apply_chat_template_kwargs or {}),
        *dataclasses.astuple(config),
    )
    if key not in _datasets:
        _datasets[key] = load_prompt_dataset(
            config.path,
            _tokenizer(args.hf_checkpoint),
            input_key=config.input_key,
            label_key=config.label_key,
            metadata_key=config.metadata_key,
            tool_key=config.tool_key,
            apply_chat_template=config.apply_chat_template,
            chat_template_kwargs=args.apply_chat_template_kwargs,
            max_prompt_len=config.max_prompt_len,
        )
    return _datasets[key]


def _eval_groups(dataset: PromptDataset, n_samples: int) -> list[list[Sample]]:
    """``n_samples`` copies of every prompt; indices are fixed so eval seeds repeat across evals."""
    groups = []
    for group_index, prompt in enumerate(dataset.samples):
        group = []
        for j in range(n_samples):
            sample = copy.deepcopy(prompt)
            sample.group_index, sample.index = group_index, group_index * n_samples + j
            sample.metadata = {**sample.metadata, "prompt_index": prompt.index}
            group.append(sample)
        groups.append(group)
    return groups


async def evaluate_dataset(
    args, config: EvalDatasetConfig, *, run_context: RunContext
) -> tuple[dict, dict[str, float]]:
    """Sample and score one eval dataset; return its data entry and its metrics."""
    dataset = _dataset(args, config)
    # the dataset's own settings, as flags for the generate and reward functions (a new namespace: args stay as parsed)
    eval_args = argparse.Namespace(
        **{
            **vars(configuration(args)),
            "rm_type": config.rm_type,
            "rollout_max_context_len": config.max_context_len,
        }
    )
    params = {
        "temperature": config.temperature,
        "top_p": config.top_p,
        "top_k": config.top_k,
        "max_tokens": config.max_response_len,
    } | shared_params(args)
    if config.min_new_tokens:
        params["min_tokens"] = config.min_new_tokens
    groups = await asyncio.gather(
        *(
            generate_group(eval_args, group, params, evaluation=True, run_context=run_context)
            for group in _eval_groups(dataset, config.n_samples)
        )
    )
    samples = [s for group in groups for s in group]
    entry = {
        "rewards": [0.0 if s.status == Status.FAILED else s.reward_value(config.reward_key) for s in samples],
        "truncated": [s.status == Status.TRUNCATED for s in samples],
        "samples": samples,
    }
    return entry, compute_eval_metrics(config.name, list(groups), reward_key=config.reward_key)


async def run_eval(args, rollout_id: int, *, run_context: RunContext | None = None) -> RolloutFnEvalOutput:
    """Evaluate every dataset of ``--eval-prompt-data`` / ``--eval-config``."""
    run_context = run_context_of(args, run_context)
    data, metrics = {}, {}
    for config in load_eval_configs(args):
        data[config.name], dataset_metrics = await evaluate_dataset(args, config, run_context=run_context)
        metrics.update(dataset_metrics)
    return RolloutFnEvalOutput(data=data, metrics=metrics)
