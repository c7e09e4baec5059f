"""``--rm-type dapo``: the DAPO-Math rule, as in slime. The answer is what follows the last ``Answer:`` in the
response's final 300 characters; after Minerva's normalisation (:func:`normalize_answer`) it must equal the label,
an integer in DAPO-Math-17k. The reward is a dict: ``score`` (1.0 or -1.0; train on it with ``--reward-key score``),
``acc`` (bool) and ``pred`` (the normalised answer, ``[INVALID]`` without an ``Answer:`` line)."""

from __future__ import annotations

import re
from typing import Any

_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
# Minerva's normalisation (Lewkowycz et al. 2022, appendix D.1), in slime's order: replacements, then removals.
_REPLACED = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
             (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))  # fmt: skip
_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges",
            "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2",
            "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"',
            "\\dots", "<|im_end|>", "<|endoftext|>")  # fmt: skip
_UNWRAPPED = (
    r"(\\text\{)(.*?)(\})",
    r"(\\textbf\{)(.*?)(\})",
    r"(\\overline\{)(.*?)(\})",
    r"(\\boxed\{)(.*)(\})",
)


def normalize_answer(text: Any) -> str:
    """A final answer in Minerva's canonical form: the part after the last ``=``, no spaces, units and ``$``; the
    first ``$...$`` kept; ``\\text``/``\\textbf``/``\\overline``/``\\boxed`` unwrapped; ``\\frac12`` and ``\\sqrt2``
    braced; an integer without thousands separators. ``18.0`` and ``18 apples`` stay as they are (not 18)."""
    text = str(text).split("=")[-1]
    for before, after in _REPLACED:
        text = text.replace(before, after)
    for removed in _REMOVED:
        text = text.replace(removed, "")
    text = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", text)
    for wrapper in _UNWRAPPED:
        text = re.sub(wrapper, r"\2", text)
    text = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", text)
    text = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", text).replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def integer_label(label: Any) -> str:
    """The label as the integer DAPO compares against (``"18.0"`` and ``\\boxed{18}`` are 18); ``ValueError`` for a
    label that is not a number, as in slime."""
    normalized = normalize_answer(label)
    try:
        return str(int(float(normalized)))
    except (ValueError, OverflowError):
        raise ValueError(
            f"rm_type 'dapo' compares against an integer label (DAPO-Math), got {label!r}; use --rm-type math for "
            "other answers"
        ) from None


def compute_dapo_reward(response: str, label: Any) -> dict[str, Any]:
    answers = _ANSWER_RE.findall(response[-300:])
    pred = normalize_answer(answers[-1]) if answers else "[INVALID]"
    correct = pred == integer_label(label)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
