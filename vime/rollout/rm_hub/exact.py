"""``--rm-type exact``: the stripped response must equal the label (used by the synthetic tiny-model task)."""

from __future__ import annotations

from typing import Any


def compute_exact_reward(response: str, label: Any) -> float:
    """1.0 if ``response.strip() == str(label).strip()``, else 0.0."""
    return 1.0 if response.strip() == str(label).strip() else 0.0
