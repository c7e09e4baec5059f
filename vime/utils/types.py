"""The data types users program against: ``Sample`` and the rollout-function outputs (DESIGN.md §3)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    """Life cycle of a sample. vLLM finish reasons map as length→TRUNCATED, abort→ABORTED, stop→COMPLETED."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"

    @classmethod
    def from_finish_reason(cls, finish_reason: str | None) -> Status:
        """Map an OpenAI/vLLM ``finish_reason`` to a status; unknown reasons raise ``ValueError``."""
        mapping = {"stop": cls.COMPLETED, "length": cls.TRUNCATED, "abort": cls.ABORTED}
        if finish_reason not in mapping:
            raise ValueError(f"unknown finish_reason {finish_reason!r}; expected one of {sorted(mapping)}")
        return mapping[finish_reason]


@dataclass
class Sample:
    """One prompt and (once generated) one response, with everything training needs.

    ``tokens`` holds prompt + response ids; ``loss_mask`` and ``rollout_log_probs`` cover the response only
    (length ``response_length``). ``failure_reason`` explains a FAILED status.
    """

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    failure_reason: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    weight_versions: list[int] = field(default_factory=list)
    rollout_id: int | None = None
    remove_sample: bool = False
    train_metadata: dict[str, Any] | None = None

    @property
    def prompt_length(self) -> int:
        """Number of prompt tokens in ``tokens``."""
        return len(self.tokens) - self.response_length

    def reward_value(self, reward_key: str | None = None) -> float:
        """The scalar reward: ``reward`` itself, or ``reward[reward_key]`` for dict rewards."""
        if isinstance(self.reward, dict):
            if reward_key is None:
                raise ValueError(
                    f"sample {self.index} has a dict reward with keys {sorted(self.reward)}; pass --reward-key"
                )
            if reward_key not in self.reward:
                raise KeyError(f"--reward-key {reward_key!r} not in reward keys {sorted(self.reward)}")
            return float(self.reward[reward_key])
        if self.reward is None:
            raise ValueError(f"sample {self.index} has no reward yet (status {self.status.value})")
        return float(self.reward)

    def mark_failed(self, reason: str) -> None:
        """Set FAILED with a human-readable reason (the batch goes on without this sample's reward)."""
        self.status = Status.FAILED
        self.failure_reason = reason

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (status as its string value)."""
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Inverse of :meth:`to_dict`; unknown keys raise so that mismatched files are noticed."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown Sample fields {sorted(unknown)}; known fields are {sorted(known)}")
        data = dict(data)
        data["status"] = Status(data.get("status", Status.PENDING.value))
        return cls(**data)


@dataclass
class RolloutFnTrainOutput:
    """What a training rollout function returns: ``rollout_batch_size`` groups of samples."""

    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    """What an eval function returns: ``{dataset: {"rewards": [...], "truncated": [...], "samples": [...]}}``."""

    data: dict[str, dict[str, list[Any]]]
    metrics: dict[str, Any] | None = None
