"""What a dynamic-sampling filter returns (slime-compatible)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicFilterOutput:
    """Whether to keep a group; ``reason`` names why a dropped group was dropped (it becomes a metric key)."""

    keep: bool
    reason: str | None = None
