"""``--rm-type deepscaler``: DeepScaleR's rule, as in slime. Only the solution after the reasoning counts (after the
last ``</think>``, or after ``###Response``); a response with neither scores 0. Its last ``\\boxed{...}`` must be
mathematically equal to the label (math-verify)."""

from __future__ import annotations

from typing import Any

from vime.rollout.rm_hub.math_utils import answers_equal, extract_boxed


def compute_deepscaler_reward(response: str, label: Any) -> float:
    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[1]
    elif "###Response" in response:
        solution = response.split("###Response", 1)[1]
    else:
        return 0.0
    answer = extract_boxed(solution)
    if answer is None or label is None or str(label) == "":
        return 0.0
    return float(answers_equal(answer.strip(), label))
