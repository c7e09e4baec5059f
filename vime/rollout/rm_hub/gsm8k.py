"""``--rm-type gsm8k``: compare the final number of a free-form response to the GSM8K label."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from vime.rollout.rm_hub.math_utils import extract_boxed

# A number: optional sign (not when glued to a word, so "16-3" yields 3), thousands groups or plain
# digits, optional decimals. "$" and a sentence's final "." fall outside the match.
_NUMBER = r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANSWER_IS_RE = re.compile(r"answer\s+is\s*:?\s*\$?\s*(" + _NUMBER + ")", re.IGNORECASE)


def _to_decimal(number: str) -> Decimal | None:
    try:
        return Decimal(number.replace(",", ""))
    except InvalidOperation:
        return None


def extract_final_number(text: str) -> str | None:
    """The response's final number, as written (commas kept), or ``None``.

    Preference: after the last ``####``; else the last number in the last ``\\boxed{}``; else after the last
    "answer is"; else the last number anywhere in the text.
    """
    hashes = _HASHES_RE.findall(text)
    if hashes:
        return hashes[-1]
    boxed = extract_boxed(text)
    boxed_numbers = _NUMBER_RE.findall(boxed) if boxed is not None else []
    if boxed_numbers:
        return boxed_numbers[-1]
    answer_is = _ANSWER_IS_RE.findall(text)
    if answer_is:
        return answer_is[-1]
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def parse_gsm8k_label(label: Any) -> Decimal:
    """The number in a GSM8K label: a raw answer text ending ``#### N``, or a bare number."""
    text = str(label)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    value = _to_decimal(text.strip().lstrip("$").strip())
    if value is None:
        raise ValueError(f"gsm8k label {str(label)[-80:]!r} is not a number and does not end with '#### N'")
    return value


def compute_gsm8k_reward(response: str, label: Any) -> float:
    """1.0 if the final number in ``response`` equals the label's number (``3.50`` == ``3.5``), else 0.0."""
    expected = parse_gsm8k_label(label)
    found = extract_final_number(response)
    return 1.0 if found is not None and _to_decimal(found) == expected else 0.0
