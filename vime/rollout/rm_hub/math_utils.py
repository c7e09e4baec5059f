"""``--rm-type math``: extract the final answer and compare it to the label with math-verify.

Equivalence is symbolic, not textual: ``\\frac{1}{2}`` == ``0.5`` == ``1/2``, ``2\\sqrt{2}`` == ``\\sqrt{8}``.
slime's plug-ins import two helpers from here: :func:`extract_answer` (the last ``\\boxed{}``'s content) and
:func:`grade_answer_verl` (is the boxed answer equal to the label), both over vime's extraction and math-verify.
"""

from __future__ import annotations

import threading
from typing import Any

# math-verify bounds parsing/comparison with signal.alarm, which only works in the main thread. Elsewhere
# (e.g. a Ray async actor's event-loop thread) we run it unbounded; --rm-timeout does not interrupt
# synchronous code, so a pathological expression can stall that thread.
_MATH_VERIFY_TIMEOUT_S = 5

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces included.

    Also accepts the brace-less form ``\\boxed 5``. Returns ``None`` if there is none or it is unbalanced.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    i = text.index("\\", start) + 1
    while i < len(text) and text[i].isalpha():
        i += 1
    if text.startswith(" ", i):  # "\boxed 5": the answer runs to the next whitespace or "$"
        rest = text[i + 1 :].split("$", 1)[0].split()
        return rest[0] if rest else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def final_answer(text: str) -> str | None:
    """The final answer: the last ``\\boxed{...}``, else the text after the last line starting ``Answer:``."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.lower().startswith("answer:"):
            answer = line[len("answer:") :].strip().rstrip(".").strip().strip("$").strip()
            return answer or None
    return None


def _parse(answer: str, timeout_s: int | None) -> list[Any]:
    from math_verify import parse  # imported on use: only --rm-type math needs it

    return parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout_s)


def compute_math_reward(response: str, label: Any) -> float:
    """1.0 if the final answer in ``response`` is mathematically equal to ``label``, else 0.0.

    ``label`` may be a bare answer (``"\\frac{1}{2}"``, ``0.5``) or a solution containing ``\\boxed{...}``.
    A response without an extractable answer scores 0.0.
    """
    if label is None:
        raise ValueError("rm_type 'math' needs a label; the sample's label is None (check --label-key)")
    answer = final_answer(response)
    return 0.0 if answer is None else float(answers_equal(answer, label))


def extract_answer(passage: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``passage``, ``None`` without one (slime's
    ``math_utils.extract_answer``; unlike :func:`final_answer`, no ``Answer:`` line is read)."""
    return extract_boxed(passage) if "\\boxed" in passage else None


def grade_answer_verl(solution_str: str, ground_truth: Any) -> bool:
    """Whether the last ``\\boxed{...}`` of ``solution_str`` is mathematically equal to ``ground_truth`` (itself
    boxed or bare), slime's grader: ``False`` without a boxed answer or with an empty ground truth. Equality is
    math-verify's (:func:`answers_equal`), where slime normalises strings and asks sympy; the two can disagree on
    edge cases (slime calls an unreduced fraction wrong)."""
    if not ground_truth:
        return False
    ground_truth = str(ground_truth)
    if "\\boxed" in ground_truth:
        ground_truth = extract_answer(ground_truth)
    given = extract_answer(solution_str)
    if given is None or not ground_truth:
        return False
    return answers_equal(given, ground_truth)


def answers_equal(answer: str, label: Any) -> bool:
    """Whether ``answer`` and ``label`` (a bare answer, or a solution with ``\\boxed{...}``) are mathematically
    equal, by math-verify."""
    gold_text = str(label)
    gold_text = extract_boxed(gold_text) or gold_text
    timeout_s = _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = _parse(gold_text, timeout_s)
    if not gold:
        raise ValueError(f"math-verify cannot parse the label {gold_text!r}")
    from math_verify import verify

    return bool(verify(gold, _parse(answer, timeout_s), timeout_seconds=timeout_s))
