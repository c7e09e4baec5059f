"""``--rm-type gpqa``: multiple choice, as in slime. The correct option comes from the sample's metadata
(``correct_letter``; ``choices`` as a list or dict; ``valid_letters``) or the label (a letter, an option index, or
an option's text); the chosen one is read from the response after any ``</think>``: an explicit "answer is X" /
"Answer: (X)", else the last standalone option letter. When no letter can be read, the response scores if it
contains the correct option's text."""

from __future__ import annotations

import re
import string
from typing import Any

_EXPLICIT_RE = (
    r"(?:final\s+)?(?:answer|option|choice)\s*(?:is|:)?\s*(?:option\s*)?\(?\b([A-Z])\b\)?",
    r"\(?\b([A-Z])\b\)?\s*is\s+(?:the\s+)?correct",
)


def _normalize(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", str(text).lower()).strip()


def _options(metadata: dict) -> tuple[list[str], list[str]]:
    """(the options' letters, their texts) from the metadata."""
    choices = metadata.get("choices") or []
    choices = [str(c) for c in (choices.values() if isinstance(choices, dict) else choices)]
    letters = metadata.get("valid_letters")
    if letters:
        letters = [str(letter).strip().upper() for letter in letters]
    else:
        letters = list(string.ascii_uppercase[: len(choices) or 10])
    return letters, choices


def _correct_letter(label: Any, metadata: dict, letters: list[str], choices: list[str]) -> str | None:
    if isinstance(metadata.get("correct_letter"), str):
        return metadata["correct_letter"].strip().upper()
    if isinstance(label, int | float) and 0 <= int(label) < len(letters):
        return letters[int(label)]
    text = str(label or "").strip()
    if text.upper() in letters:
        return text.upper()
    matches = [i for i, choice in enumerate(choices) if _normalize(choice) == _normalize(text)]
    return letters[matches[0]] if matches and matches[0] < len(letters) else None


def _chosen_letter(response: str, letters: list[str]) -> str | None:
    for pattern in _EXPLICIT_RE:
        found = [
            m.upper() for m in re.findall(pattern, response, flags=re.IGNORECASE) if m.upper() in letters
        ]
        if found:
            return found[-1]
    standalone = [m for m in re.findall(r"\b([A-Z])\b", response) if m in letters]
    return standalone[-1] if standalone else None


def compute_gpqa_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    metadata = metadata or {}
    text = (response or "").rsplit("</think>", 1)[-1]
    letters, choices = _options(metadata)
    correct = _correct_letter(label, metadata, letters, choices)
    chosen = _chosen_letter(text, letters)
    if chosen is not None and correct is not None:
        return float(chosen == correct)
    targets = [str(label or "")]
    if correct in letters and letters.index(correct) < len(choices):
        targets.append(choices[letters.index(correct)])
    normalized = _normalize(text)
    return float(any(_normalize(t) and _normalize(t) in normalized for t in targets))
