"""Supervised fine-tuning as a rollout function (slime's ``slime.rollout.sft_rollout``): no engines generate;
each prompt is a whole chat conversation that becomes one training sample.

    --rollout-function-path vime.rollout.sft_rollout.generate_rollout --loss-type sft_loss
    --input-key messages --debug-train-only --calculate-per-token-loss

A sample's tokens are the conversation under the tokenizer's chat template; its response starts at the first
trained token (the first assistant turn) and its loss mask trains the assistant turns only
(:func:`vime.utils.conversation.tokenize_conversation`; ``"step_loss_mask": 0`` on a message leaves it out).
Tools come from ``--tool-key`` (the sample's ``metadata["tools"]`` otherwise).
"""

from __future__ import annotations

from transformers import AutoTokenizer

from vime.utils.conversation import tokenize_conversation
from vime.utils.types import RolloutFnTrainOutput, Sample, Status

_tokenizers: dict[str, object] = {}


def _tokenizer(path: str):
    if path not in _tokenizers:
        _tokenizers[path] = AutoTokenizer.from_pretrained(path)
    return _tokenizers[path]


def conversation_sample(args, sample: Sample) -> Sample:
    """Fill ``sample`` (its ``prompt`` a list of chat messages) with the conversation's tokens and loss mask."""
    messages = sample.prompt
    if not isinstance(messages, list):
        raise ValueError(
            f"prompt {sample.metadata.get('prompt_index', sample.index)}: SFT needs chat messages (a list of "
            f"{{'role', 'content'}}) under --input-key {args.input_key!r}, got {type(messages).__name__}"
        )
    tools = sample.metadata.get("tools")
    try:
        tokens, mask = tokenize_conversation(
            _tokenizer(args.hf_checkpoint), messages, tools, args.apply_chat_template_kwargs
        )
    except ValueError as e:
        raise ValueError(f"prompt {sample.metadata.get('prompt_index', sample.index)}: {e}") from None
    if 1 not in mask:
        raise ValueError(
            f"prompt {sample.metadata.get('prompt_index', sample.index)}: the conversation has no assistant turn "
            "to train on"
        )
    response_length = len(mask) - mask.index(1)
    sample.tokens = tokens
    sample.response_length = response_length
    sample.loss_mask = mask[-response_length:]
    sample.reward = 0.0
    sample.status = Status.COMPLETED
    return sample


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> RolloutFnTrainOutput:
    """``--rollout-batch-size`` conversations from the data buffer as training samples (one per prompt)."""
    if evaluation:
        raise ValueError(
            "vime.rollout.sft_rollout has no evaluation; set --eval-function-path or drop --eval-interval"
        )
    if args.n_samples_per_prompt != 1:
        raise ValueError(
            f"SFT trains each conversation once: set --n-samples-per-prompt 1 (got {args.n_samples_per_prompt})"
        )
    groups = [
        [conversation_sample(args, s) for s in group]
        for group in data_source.get_samples(args.rollout_batch_size)
    ]
    samples = [s for group in groups for s in group]
    trained = [sum(s.loss_mask) for s in samples]
    metrics = {
        "rollout/response_length_mean": sum(s.response_length for s in samples) / len(samples),
        "rollout/trained_tokens": sum(trained),
        "rollout/tokens_mean": sum(len(s.tokens) for s in samples) / len(samples),
    }
    return RolloutFnTrainOutput(samples=groups, metrics=metrics)
