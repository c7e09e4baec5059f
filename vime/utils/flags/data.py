"""Prompt-data flags: files, keys, chat templates, length limits.

Each group is a list of ``(flag, add_argument kwargs)``; ``vime.utils.arguments`` builds the parser."""

from __future__ import annotations

from vime.utils.flags.types import json_dict

DATA = [
    ("--hf-checkpoint", dict(default=None, help="HF model dir: tokenizer, config, and initial weights.")),
    ("--prompt-data", dict(default=None, help="Prompt file (.jsonl/.parquet), optionally PATH@[start:end].")),
    ("--input-key", dict(default="prompt", help="Field holding the prompt (string or chat messages).")),
    ("--label-key", dict(default="label", help="Field holding the label.")),
    ("--metadata-key", dict(default="metadata", help="Field holding per-sample metadata (a JSON object).")),
    ("--tool-key", dict(default=None, help="Field holding tool definitions passed to the chat template.")),
    (
        "--apply-chat-template",
        dict(action="store_true", help="Render prompts with the tokenizer's chat template."),
    ),
    (
        "--apply-chat-template-kwargs",
        dict(type=json_dict, default={}, help="JSON kwargs for apply_chat_template."),
    ),
    (
        "--disable-rollout-global-dataset",
        dict(
            action="store_false",
            dest="rollout_global_dataset",
            help="No prompt dataset (slime): the data source hands out empty samples (after its buffer) to a "
            "--rollout-function-path that makes its own prompts; --prompt-data is then not read.",
        ),
    ),
    (
        "--rollout-max-context-len",
        dict(
            type=int,
            default=None,
            help="Prompt + response token cap: a response stops at this context length (TRUNCATED).",
        ),
    ),
    (
        "--rollout-max-prompt-len",
        dict(
            type=int, default=None, help="Drop prompts longer than this many tokens (counted and reported)."
        ),
    ),
    (
        "--rollout-shuffle",
        dict(action="store_true", help="Shuffle prompts each epoch (seeded by --rollout-seed and epoch)."),
    ),
    (
        "--rollout-seed",
        dict(type=int, default=42, help="Seed for prompt shuffling, engines and per-sample sampling seeds."),
    ),
]
