"""``--rm-type math``: the last ``\\boxed{...}`` of the response must equal the label, with slime's meaning.

An answer outside a ``\\boxed{}`` (an ``Answer:`` line, a final sentence) is not read: such a response scores 0, as
in slime. Equality is :func:`vime.rollout.rm_hub.math_equivalence.answers_equal`. slime's plug-ins import two helpers
from here: :func:`extract_answer` (the last ``\\boxed{}``'s content) and :func:`grade_answer_verl`.
"""

from __future__ import annotations

from typing import Any

from vime.rollout.rm_hub.math_equivalence import answers_equal


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text``, nested braces included, as slime reads it: None when
    there is no ``\\boxed``, when the last one is not followed at once by ``{`` (``\\boxed 5``) or its braces do
    not close. ``\\fbox`` does not count."""
    start = text.rfind("\\boxed")
    if start < 0 or not text.startswith("{", start + len("\\boxed")):
        return None
    depth = 0
    for end in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start + len("\\boxed{") : end]
    return None


def extract_answer(passage: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``passage``, None without one (slime's
    ``math_utils.extract_answer``)."""
    return extract_boxed(passage)


def grade_answer_verl(solution_str: str, ground_truth: Any) -> bool:
    """Whether the last ``\\boxed{...}`` of ``solution_str`` equals ``ground_truth`` (a bare answer, or a solution
    whose last ``\\boxed{}`` is the answer), slime's grader: False without a boxed answer or with an empty ground
    truth."""
    truth = str(ground_truth)
    if "\\boxed" in truth:
        truth = extract_boxed(truth) or ""
    given = extract_boxed(solution_str)
    if given is None or not truth:
        return False
    return answers_equal(given, truth)


def compute_math_reward(response: str, label: Any) -> float:
    """1.0 if the last ``\\boxed{...}`` in ``response`` equals ``label`` (see :func:`grade_answer_verl`), else 0.0.
    A missing label (None) is a data error: ``ValueError``."""
    if label is None:
        raise ValueError("rm_type 'math' needs a label; the sample's label is None (check --label-key)")
    return float(grade_answer_verl(response, label))
