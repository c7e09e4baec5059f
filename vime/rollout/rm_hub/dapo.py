"""``--rm-type dapo``: the DAPO-Math rule, as in slime. The answer is what follows the last ``Answer:`` in the
response's final 300 characters; after normalisation (TeX wrappers, ``$``, units, thousands separators) it must
equal the label, an integer in DAPO-Math-17k. The reward is a dict: ``score`` (1.0 or -1.0; train on it with
``--reward-key score``), ``acc`` (bool) and ``pred`` (the normalised answer)."""

from __future__ import annotations

import re
from typing import Any

from vime.rollout.rm_hub.math_utils import extract_boxed

_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_WRAPPER_RE = re.compile(r"\\(?:boxed|text|textbf|mathrm|mbox|overline)\{([^{}]*)\}")
_NUMBER_WITH_UNITS_RE = re.compile(r"(-?[\d,]*\.?\d+)\s*(?:[a-zA-Z]+\.?\s*)*$")
_DROPPED = ("$", "\\!", "\\,", "\\;", "{,}", "^\\circ", "^{\\circ}", "\\%", "%")


def normalize_answer(text: str) -> str:
    """A final answer in a canonical form: the part after the last ``=``, TeX wrappers and ``$`` removed, no
    spaces; a number keeps no units, thousands separators or trailing ``.0``."""
    text = str(text).split("=")[-1].strip().rstrip(".")
    previous = None
    while previous != text:
        previous, text = text, _WRAPPER_RE.sub(r"\1", text)
    for token in _DROPPED:
        text = text.replace(token, "")
    number = _NUMBER_WITH_UNITS_RE.fullmatch(text.strip())
    if number:
        text = number.group(1).replace(",", "")
        try:
            value = float(text)
        except ValueError:
            pass
        else:
            text = str(int(value)) if value.is_integer() else str(value)
    return text.replace(" ", "")


def compute_dapo_reward(response: str, label: Any) -> dict[str, Any]:
    answers = _ANSWER_RE.findall(response[-300:])
    pred = normalize_answer(answers[-1]) if answers else "[INVALID]"
    gold = normalize_answer(extract_boxed(str(label)) or str(label))
    correct = pred == gold
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
