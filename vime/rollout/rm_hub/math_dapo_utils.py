"""The DAPO-Math scorer where slime's plug-ins import it (``slime.rollout.rm_hub.math_dapo_utils.compute_score``);
the rule itself is ``--rm-type dapo``'s (:mod:`vime.rollout.rm_hub.dapo`)."""

from __future__ import annotations

from typing import Any

from vime.rollout.rm_hub.dapo import compute_dapo_reward
from vime.rollout.rm_hub.math_utils import extract_boxed

# compute_score reads only the response's end: the longest MATH-500 answer is 159 characters
_TAIL_CHARS = 300
_STRICT_TAIL_CHARS = 100


def compute_score(
    solution_str: str,
    ground_truth: Any,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> dict[str, Any]:
    """``{"score": 1.0 | -1.0, "acc": bool, "pred": str | None}`` for a response (slime's signature).

    By default the ``Answer:`` rule of ``--rm-type dapo``. With ``strict_box_verify`` the last ``\\boxed{...}`` in
    the final 100 characters (counted from ``pause_tokens_index[-1] - 100`` when given; four indices) must equal
    ``ground_truth`` as a string."""
    solution_str = solution_str[-_TAIL_CHARS:]
    if not strict_box_verify:
        return compute_dapo_reward(solution_str, ground_truth)
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index needs 4 indices, got {len(pause_tokens_index)}")
        tail = solution_str[pause_tokens_index[-1] - _STRICT_TAIL_CHARS :]
    else:
        tail = solution_str[-_STRICT_TAIL_CHARS:]
    pred = extract_boxed(tail)
    correct = pred == ground_truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
