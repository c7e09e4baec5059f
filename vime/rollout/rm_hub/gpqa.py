"""``--rm-type gpqa``: multiple choice, as in slime.

The correct option comes from the sample's metadata (``correct_letter``; ``choices`` as a list or dict;
``valid_letters``, default A-J or one per choice) or the label (a letter, an option index, or an option's text). The
chosen one is read from the response after its last ``</think>``: the first "answer is X" / "X is correct" / "final
answer: X" (tried in that order), else the last standalone capital option letter. Without both letters, the response
scores if it contains the text of the correct option (or the metadata's ``correct_answer`` / ``answer_text``, or the
label); failing that, a chosen letter is compared with the label as a letter.

One difference from slime, whose patterns can read the first letter of a word (``answer is clearly B`` chose C): the
chosen letter must stand alone.
"""

from __future__ import annotations

import re
import string
from typing import Any

_EXPLICIT_RE = tuple(
    re.compile(pattern, re.IGNORECASE)
    for pattern in (
        r"(?:answer|option|choice)\s*(?:is|:)?\s*\b([A-Z])\b",
        r"\b([A-Z])\s*is\s*(?:the)?\s*correct",
        r"final\s*(?:answer|option)\s*(?:is|:)?\s*\b([A-Z])\b",
    )
)


def _normalize(text: Any) -> str:
    return re.sub(r"[^a-z0-9]+", " ", str(text).lower()).strip()


def _options(metadata: dict) -> tuple[list[str], list[str]]:
    """(the options' letters, their texts) from the metadata."""
    choices = metadata.get("choices") or []
    choices = [str(c) for c in (choices.values() if isinstance(choices, dict) else choices)]
    if metadata.get("valid_letters"):
        letters = [str(letter).upper() for letter in metadata["valid_letters"]]
    else:
        letters = list(string.ascii_uppercase[: len(choices) or 10])
    return letters, choices


def _correct_letter(label: Any, metadata: dict, letters: list[str], choices: list[str]) -> str | None:
    if isinstance(label, int | float) and 0 <= int(label) < len(letters):  # an index wins, as in slime
        return letters[int(label)]
    if isinstance(metadata.get("correct_letter"), str):
        return metadata["correct_letter"].strip().upper()
    text = label.strip() if isinstance(label, str) else ""
    if len(text) == 1 and text.upper() in letters:
        return text.upper()
    for index, choice in enumerate(choices):
        if text and _normalize(choice) == _normalize(text):
            return letters[index]
    return None


def _chosen_letter(response: str, letters: list[str]) -> str | None:
    for pattern in _EXPLICIT_RE:
        match = pattern.search(response)
        if match and match.group(1).upper() in letters:
            return match.group(1).upper()
    standalone = [letter for letter in re.findall(r"\b([A-Z])\b", response) if letter in letters]
    return standalone[-1] if standalone else None


def compute_gpqa_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    metadata = metadata or {}
    text = (response or "").rsplit("</think>", 1)[-1]
    letters, choices = _options(metadata)
    correct = _correct_letter(label, metadata, letters, choices)
    chosen = _chosen_letter(text, letters)
    if chosen and correct:
        return float(chosen == correct)
    label_text = label.strip() if isinstance(label, str) else ""
    targets = [metadata.get("correct_answer"), metadata.get("answer_text"), label_text]
    if correct in letters and letters.index(correct) < len(choices):
        targets.append(choices[letters.index(correct)])
    if any(_normalize(t) and _normalize(t) in _normalize(text) for t in targets if t):
        return 1.0
    if chosen and not correct and label_text:
        return float(chosen == label_text.upper())
    return 0.0
