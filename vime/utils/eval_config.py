"""Eval datasets and their settings, from ``--eval-prompt-data NAME PATH ...`` or ``--eval-config FILE.yaml``.

The YAML schema (every key except ``name`` and ``path`` is optional)::

    eval:
      defaults:                 # apply to every dataset; any EvalDatasetConfig field but name/path
        n_samples: 4
        temperature: 0.6
      datasets:
        - name: gsm8k           # metric prefix eval/gsm8k/...; unique, no "/"
          path: data/gsm8k_test.jsonl@[:200]
          rm_type: gsm8k
          n_samples: 8          # overrides defaults, which override the command-line flags
                                # (slime's key n_samples_per_eval_prompt is read as n_samples)

Precedence per field: dataset entry > ``eval.defaults`` > flags (``--n-samples-per-eval-prompt``,
``--eval-temperature``, ``--eval-top-p``, ``--eval-top-k``, ``--eval-max-response-len``, ``--rm-type``,
``--eval-input-key``/``--input-key``, ``--eval-label-key``/``--label-key``, ``--metadata-key``,
``--eval-tool-key``/``--tool-key``, ``--apply-chat-template``, ``--eval-reward-key``, ``--eval-min-new-tokens``,
``--eval-max-prompt-len``, ``--eval-max-context-len``/``--rollout-max-context-len``). Passing both ``--eval-prompt-data`` and ``--eval-config`` is an error: one source of
eval datasets, so that no flag is silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass
class EvalDatasetConfig:
    """One eval dataset and how to sample and score it."""

    name: str
    """Dataset name; metrics are logged as ``eval/{name}/...``."""
    path: str
    """Prompt file, ``.jsonl`` or ``.parquet``, optionally ``PATH@[start:end]``."""
    rm_type: str | None
    """Built-in reward (``--rm-type``); ``None`` when ``--custom-rm-path`` scores."""
    n_samples: int
    """Responses sampled per prompt (pass@k is reported for k = 1, 2, 4, ... up to this)."""
    temperature: float
    """Sampling temperature."""
    top_p: float
    """Top-p."""
    top_k: int
    """Top-k (-1: off)."""
    max_response_len: int
    """Max new tokens per response."""
    input_key: str
    """Row field holding the prompt."""
    label_key: str | None
    """Row field holding the label."""
    metadata_key: str | None
    """Row field holding per-sample metadata."""
    tool_key: str | None
    """Row field holding tool definitions for the chat template."""
    apply_chat_template: bool
    """Render prompts with the tokenizer's chat template."""
    reward_key: str | None
    """Key of a dict reward to report (``--eval-reward-key``)."""
    min_new_tokens: int
    """Min new tokens per response (``--eval-min-new-tokens``)."""
    max_prompt_len: int | None
    """Drop prompts longer than this many tokens (``--eval-max-prompt-len``)."""
    max_context_len: int | None
    """Prompt + response token cap (``--eval-max-context-len``, else ``--rollout-max-context-len``)."""


FIELDS = [f.name for f in dataclasses.fields(EvalDatasetConfig)]
# slime's eval-YAML keys that vime names differently
SLIME_KEYS = {"n_samples_per_eval_prompt": "n_samples"}
# Accepted YAML value types per field (None is accepted where the field is optional).
_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "path": (str,),
    "rm_type": (str, type(None)),
    "n_samples": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "max_response_len": (int,),
    "input_key": (str,),
    "label_key": (str, type(None)),
    "metadata_key": (str, type(None)),
    "tool_key": (str, type(None)),
    "apply_chat_template": (bool,),
    "reward_key": (str, type(None)),
    "min_new_tokens": (int,),
    "max_prompt_len": (int, type(None)),
    "max_context_len": (int, type(None)),
}


def load_eval_configs(args: argparse.Namespace) -> list[EvalDatasetConfig]:
    """The eval datasets of this run (empty when neither ``--eval-prompt-data`` nor ``--eval-config`` is set)."""
    if args.eval_prompt_data and args.eval_config:
        raise ValueError(
            f"both --eval-prompt-data {' '.join(args.eval_prompt_data)} and --eval-config {args.eval_config} are "
            "set; pass one: list the datasets in the YAML's eval.datasets, or drop --eval-config"
        )
    if args.eval_config:
        return _from_yaml(args, Path(args.eval_config))
    pairs = args.eval_prompt_data or []
    if len(pairs) % 2:
        raise ValueError(f"--eval-prompt-data takes NAME PATH pairs; got {len(pairs)} values: {pairs}")
    entries = [{"name": name, "path": path} for name, path in zip(pairs[::2], pairs[1::2], strict=True)]
    return _build(args, {}, entries, "--eval-prompt-data")


def _flag_defaults(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "rm_type": args.rm_type,
        "n_samples": args.n_samples_per_eval_prompt,
        "temperature": args.eval_temperature,
        "top_p": args.eval_top_p,
        "top_k": args.eval_top_k,
        "max_response_len": args.eval_max_response_len,
        "input_key": args.eval_input_key or args.input_key,
        "label_key": args.eval_label_key or args.label_key,
        "metadata_key": args.metadata_key,
        "tool_key": args.eval_tool_key or args.tool_key,
        "apply_chat_template": args.apply_chat_template,
        "reward_key": args.eval_reward_key,
        "min_new_tokens": args.eval_min_new_tokens,
        "max_prompt_len": args.eval_max_prompt_len,
        "max_context_len": args.eval_max_context_len or args.rollout_max_context_len,
    }


def _from_yaml(args: argparse.Namespace, path: Path) -> list[EvalDatasetConfig]:
    if not path.is_file():
        raise ValueError(f"--eval-config {path}: file not found")
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"--eval-config {path}: not valid YAML: {exc}") from None
    section = document.get("eval") if isinstance(document, dict) else None
    if not isinstance(section, dict):
        raise ValueError(f"--eval-config {path}: expected a top-level 'eval:' mapping with 'datasets:'")
    _check_keys(section, ["defaults", "datasets"], f"section 'eval' of {path}")
    defaults = section.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ValueError(
            f"--eval-config {path}: eval.defaults must be a mapping, got {type(defaults).__name__}"
        )
    defaults = _vime_keys(defaults, f"eval.defaults of {path}")
    _check_keys(defaults, [f for f in FIELDS if f not in ("name", "path")], f"eval.defaults of {path}")
    entries = section.get("datasets")
    if not isinstance(entries, list) or not entries:
        raise ValueError(
            f"--eval-config {path}: eval.datasets must be a non-empty list of {{name, path, ...}}"
        )
    return _build(args, defaults, entries, str(path))


def _build(
    args: argparse.Namespace, defaults: dict[str, Any], entries: list[Any], source: str
) -> list[EvalDatasetConfig]:
    configs: list[EvalDatasetConfig] = []
    for position, entry in enumerate(entries):
        where = f"eval dataset #{position} in {source}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping with name and path, got {entry!r}")
        if isinstance(entry.get("name"), str):
            where = f"eval dataset {entry['name']!r} in {source}"
        entry = _vime_keys(entry, where)
        _check_keys(entry, FIELDS, where)
        for key in ("name", "path"):
            if not entry.get(key):
                raise ValueError(f"{where}: missing {key!r}")
        values = {**_flag_defaults(args), **defaults, **entry}
        for key, value in values.items():
            if not isinstance(value, _TYPES[key]) or (isinstance(value, bool) and bool not in _TYPES[key]):
                origin = "the entry" if key in entry else "eval.defaults" if key in defaults else "the flags"
                allowed = " or ".join("null" if t is type(None) else t.__name__ for t in _TYPES[key])
                raise ValueError(f"{where}: {key} = {value!r} (from {origin}) must be {allowed}")
            if float in _TYPES[key]:
                values[key] = float(value)
        if "/" in values["name"]:
            raise ValueError(
                f"{where}: the name may not contain '/' (it becomes the metric prefix eval/NAME/)"
            )
        if values["n_samples"] < 1:
            raise ValueError(f"{where}: n_samples = {values['n_samples']} must be >= 1")
        if any(config.name == values["name"] for config in configs):
            raise ValueError(
                f"{source}: eval dataset name {values['name']!r} appears twice; names must be unique"
            )
        configs.append(EvalDatasetConfig(**values))
    return configs


def _vime_keys(mapping: dict[str, Any], where: str) -> dict[str, Any]:
    """``mapping`` with slime's key names (:data:`SLIME_KEYS`) renamed to vime's."""
    renamed = dict(mapping)
    for slime_key, key in SLIME_KEYS.items():
        if slime_key in renamed:
            if key in renamed:
                raise ValueError(f"{where}: both {slime_key!r} (slime's name) and {key!r} are set; keep one")
            renamed[key] = renamed.pop(slime_key)
    return renamed


def _check_keys(mapping: dict[str, Any], valid: list[str], where: str) -> None:
    for key in mapping:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{where}: unknown key {key!r}{hint}; valid keys: {', '.join(valid)}")
