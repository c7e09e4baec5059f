"""Prompt datasets: JSONL/Parquet files, ``path@[start:end]`` slicing, keys, chat templates, length filter.

Bad input fails early with the file, the line (or Parquet row), what was found and what was expected.
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vime.utils.types import Sample

logger = logging.getLogger(__name__)

_SLICE = re.compile(r"^(?P<path>.+)@\[(?P<start>-?\d*):(?P<end>-?\d*)\]$")


class DataError(ValueError):
    """A prompt file that cannot be used as given."""


@dataclass(frozen=True)
class DataSpec:
    """A data file and an optional ``[start:end]`` row slice (Python semantics)."""

    path: Path
    start: int | None = None
    end: int | None = None

    @classmethod
    def parse(cls, spec: str) -> DataSpec:
        """Parse ``path`` or ``path@[start:end]`` (either bound may be empty)."""
        match = _SLICE.match(spec)
        if not match:
            if "@[" in spec:
                raise DataError(f"bad slice in {spec!r}: expected PATH@[start:end] with integer bounds")
            return cls(Path(spec))
        to_int = lambda text: int(text) if text else None  # noqa: E731
        return cls(Path(match["path"]), to_int(match["start"]), to_int(match["end"]))

    def select(self, num_rows: int) -> range:
        """The row indices this slice keeps, checking that its bounds lie inside the file."""
        for name, bound in (("start", self.start), ("end", self.end)):
            if bound is not None and not -num_rows <= bound <= num_rows:
                raise DataError(
                    f"{self.path}@[{_fmt(self.start)}:{_fmt(self.end)}]: slice {name} {bound} is out of range "
                    f"for a file of {num_rows} rows"
                )
        selected = range(num_rows)[self.start : self.end]
        if not selected:
            raise DataError(
                f"{self.path}@[{_fmt(self.start)}:{_fmt(self.end)}] selects no rows (the file has {num_rows})"
            )
        return selected


def _fmt(bound: int | None) -> str:
    return "" if bound is None else str(bound)


def read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(location, row)`` from a ``.jsonl`` or ``.parquet`` file; location reads ``file:line``."""
    if not path.exists():
        raise DataError(f"prompt file not found: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for index, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}:row {index}", row
        return
    if path.suffix not in (".jsonl", ".json"):
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl or .parquet")
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                text = line.strip()
                shown = text if len(text) <= 120 else text[:117] + "..."
                raise DataError(
                    f"{path}:{line_no}: malformed JSON ({exc.msg} at column {exc.colno}): {shown}"
                ) from None
            if not isinstance(row, dict):
                raise DataError(
                    f"{path}:{line_no}: expected a JSON object per line, got {type(row).__name__}"
                )
            yield f"{path}:{line_no}", row


def _field(row: dict[str, Any], key: str, location: str, flag: str) -> Any:
    if key not in row:
        raise DataError(f"{location}: missing key {key!r} (set by {flag}); this row has keys {sorted(row)}")
    return row[key]


def _check_messages(prompt: list, location: str) -> None:
    for message in prompt:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(
                f"{location}: a chat prompt must be a list of {{'role', 'content'}} messages, got {message!r}"
            )


@dataclass
class PromptDataset:
    """Prompts ready for rollout: ``samples[i].tokens`` holds the prompt ids; ``index`` is the row order."""

    samples: list[Sample]
    num_too_long: int = 0

    def __len__(self) -> int:
        return len(self.samples)

    def epoch_order(self, epoch: int, seed: int, shuffle: bool) -> list[int]:
        """Sample positions for ``epoch``: a permutation fixed by (seed, epoch), or file order."""
        order = list(range(len(self.samples)))
        if shuffle:
            random.Random(f"{seed}-{epoch}").shuffle(order)
        return order


def load_prompt_dataset(
    spec: str,
    tokenizer,
    *,
    input_key: str = "prompt",
    label_key: str | None = "label",
    metadata_key: str | None = "metadata",
    tool_key: str | None = None,
    apply_chat_template: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    max_prompt_len: int | None = None,
    keep_messages: bool = False,
) -> PromptDataset:
    """Load ``spec`` (``path`` or ``path@[start:end]``) into samples with tokenized prompts.

    A prompt is a string or a list of chat messages; messages need ``apply_chat_template``, unless
    ``keep_messages`` (SFT: ``--loss-type sft_loss``), which keeps them as the sample's ``prompt``, untokenized,
    with the row's tools in ``metadata["tools"]``. Prompts longer than ``max_prompt_len`` tokens are dropped,
    counted in ``num_too_long`` and logged.
    """
    data_spec = DataSpec.parse(spec)
    rows = list(read_rows(data_spec.path))
    if not rows:
        raise DataError(f"{data_spec.path}: the file has no rows")
    samples, num_too_long = [], 0
    for row_index in data_spec.select(len(rows)):
        location, row = rows[row_index]
        prompt = _field(row, input_key, location, "--input-key")
        if isinstance(prompt, list):
            _check_messages(prompt, location)
            if not apply_chat_template and not keep_messages:
                raise DataError(
                    f"{location}: the prompt is a list of chat messages; pass --apply-chat-template"
                )
        elif not isinstance(prompt, str):
            raise DataError(
                f"{location}: {input_key!r} must be a string or a list of messages, got {type(prompt).__name__}"
            )
        metadata = row.get(metadata_key, {}) if metadata_key else {}
        if isinstance(metadata, str):
            try:
                metadata = json.loads(metadata)
            except json.JSONDecodeError:
                raise DataError(
                    f"{location}: {metadata_key!r} is a string that is not JSON: {metadata[:80]!r}"
                ) from None
        if not isinstance(metadata, dict):
            raise DataError(f"{location}: {metadata_key!r} must be an object, got {type(metadata).__name__}")
        tools = _field(row, tool_key, location, "--tool-key") if tool_key else None
        if keep_messages and isinstance(
            prompt, list
        ):  # a conversation: its answers are in it, a label is optional
            label = row.get(label_key) if label_key else None
            if tools is not None:
                metadata = {**metadata, "tools": tools}
            samples.append(Sample(index=row_index, prompt=prompt, label=label, metadata=metadata))
            continue
        label = _field(row, label_key, location, "--label-key") if label_key else None
        if apply_chat_template:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=True,
                **(chat_template_kwargs or {}),
            )
            token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            text = prompt
            token_ids = tokenizer(text)["input_ids"]
        if max_prompt_len is not None and len(token_ids) > max_prompt_len:
            num_too_long += 1
            continue
        samples.append(Sample(index=row_index, prompt=text, tokens=token_ids, label=label, metadata=metadata))
    if num_too_long:
        logger.warning(
            "%s: dropped %d of %d prompts longer than the max prompt length, %d tokens",
            data_spec.path,
            num_too_long,
            num_too_long + len(samples),
            max_prompt_len,
        )
    if not samples:
        raise DataError(
            f"{spec}: no prompts left after dropping {num_too_long} longer than the max prompt length "
            f"({max_prompt_len} tokens: --rollout-max-prompt-len / --eval-max-prompt-len)"
        )
    return PromptDataset(samples=samples, num_too_long=num_too_long)
