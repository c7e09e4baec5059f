"""``--rm-type deepscaler``: DeepScaleR's rule, as in slime. Only the solution after the reasoning counts: after the
last ``</think>``, else between the first ``###Response`` and the next one; a response with neither scores 0. Its
last ``\\boxed{...}`` must equal the label (:func:`~vime.rollout.rm_hub.math_equivalence.answers_equal`; a label
holding a ``\\boxed{}`` is read as its content)."""

from __future__ import annotations

from typing import Any

from vime.rollout.rm_hub.math_equivalence import answers_equal
from vime.rollout.rm_hub.math_utils import extract_boxed


def compute_deepscaler_reward(response: str, label: Any) -> float:
    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    answer = extract_boxed(solution)
    truth = "" if label is None else str(label)
    if "\\boxed" in truth:
        truth = extract_boxed(truth) or ""
    if answer is None or not truth:
        return 0.0
    return float(answers_equal(answer, truth))
