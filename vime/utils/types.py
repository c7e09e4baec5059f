"""The data types users program against: ``Sample`` and the rollout-function outputs (DESIGN.md §3)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

import numpy as np

from vime.utils import routed_experts


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


# Fields of slime's Sample that vime does not use, with slime's defaults. A Sample answers to them as attributes
# (the default until one is set), and ``to_dict``/``from_dict`` carry the ones set, so slime's dict shape
# round-trips and slime plug-ins can read and write them.
SLIME_ONLY_FIELDS: dict[str, Callable[[], Any]] = {
    "multimodal_inputs": lambda: None,
    "multimodal_train_inputs": lambda: None,
    "multimodal_train_input_id": lambda: None,
    "apply_chat_template_kwargs": dict,
    "rollout_top_p_token_ids": lambda: None,
    "rollout_top_p_token_offsets": lambda: None,
    "rollout_topk_token_ids": lambda: None,
    "rollout_topk_log_probs": lambda: None,
    "generate_function_path": lambda: None,
    "custom_rm_path": lambda: None,
    "session_id": lambda: None,
    "non_generation_time": lambda: 0.0,
    "spec_info": lambda: None,
    "prefix_cache_info": lambda: None,
}


@dataclass
class Sample:
    """One prompt and (once generated) one response, with everything training needs.

    ``tokens`` holds prompt + response ids; ``loss_mask`` and ``rollout_log_probs`` cover the response only
    (length ``response_length``). ``failure_reason`` explains a FAILED status. As in slime, ``rollout_id``
    identifies the trajectory a sample belongs to (None: the sample is its own; a plug-in that splits one
    trajectory into several samples sets it on every sibling), and ``Sample.Status`` is the status enum.
    ``rollout_step`` is the training step whose rollout produced the sample. ``rollout_routed_experts`` (MoE, with
    ``--use-rollout-routing-replay``): the experts the engine routed each token to, ``[len(tokens) - 1, layers,
    topk]`` (``vime.utils.routed_experts``); a continued sample holds the routing of its latest request. ``teacher_log_probs`` (len
    ``response_length``) are a distillation teacher's log-probs of the response, set during the rollout for
    ``--use-opd --opd-type vllm`` (:mod:`vime.rollout.on_policy_distillation`). ``weight_versions``: the weight
    versions that generated the response, in order (one per request; a request that a weight sync paused in place
    lists each version that sampled its tokens, with ``--flush-cache-interval``). ``weight_version_spans``:
    ``[version, start, end]`` per stretch of generated response tokens (positions ``start:end`` of the response),
    exact with ``--flush-cache-interval`` (vLLM's per-token labels), else the version each request was sent at.
    """

    Status: ClassVar = Status

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
    teacher_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    failure_reason: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    weight_versions: list[int] = field(default_factory=list)
    weight_version_spans: list[list[int]] = field(default_factory=list)
    rollout_id: int | None = None
    rollout_step: int | None = None
    remove_sample: bool = False
    train_metadata: dict[str, Any] | None = None
    # not part of ==: numpy arrays do not compare to one bool (compare them with np.array_equal)
    rollout_routed_experts: np.ndarray | None = field(default=None, compare=False)

    def __getattr__(self, name: str) -> Any:
        # only reached when normal lookup fails: a slime-only field never set on this sample
        factory = SLIME_ONLY_FIELDS.get(name)
        if factory is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = factory()
        if isinstance(value, dict):  # a mutable default: keep what the caller changes in it
            setattr(self, name, value)
        return value

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

    def get_reward_value(self, args) -> float:
        """slime's accessor: the scalar reward under ``args.reward_key``."""
        return self.reward_value(getattr(args, "reward_key", None))

    @property
    def effective_response_length(self) -> int:
        """Response tokens that train (the loss mask's ones; all of them without a mask)."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def append_response_tokens(
        self,
        args: Any = None,
        *,
        tokens: Sequence[int] = (),
        log_probs: Sequence[float] | None = None,
        trainable: bool = True,
        meta_info: dict[str, Any] | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """Append response tokens, keeping ``loss_mask`` and ``rollout_log_probs`` aligned (slime's signature).

        Generated tokens pass ``trainable=True`` with their ``log_probs``; tool or environment tokens pass
        ``trainable=False`` (loss mask 0, log-prob 0). ``meta_info={"finish_reason": ...}`` (a vLLM finish reason,
        or SGLang's ``{"type": ...}``) sets the status when ``update_terminal_info``."""
        tokens = [int(t) for t in tokens]
        if trainable and tokens and log_probs is None:
            raise ValueError("trainable response tokens need their rollout log-probs (log_probs=...)")
        if not trainable and log_probs is not None:
            raise ValueError("tokens with trainable=False (tool/environment output) take no log_probs")
        log_probs = (
            [float(lp) for lp in log_probs] if trainable and log_probs is not None else [0.0] * len(tokens)
        )
        if len(log_probs) != len(tokens):
            raise ValueError(f"{len(log_probs)} log-probs for {len(tokens)} tokens")
        if self.loss_mask is None:
            self.loss_mask = [1] * self.response_length
        if self.rollout_log_probs is None:
            self.rollout_log_probs = [0.0] * self.response_length
        for name in ("loss_mask", "rollout_log_probs"):
            if len(getattr(self, name)) != self.response_length:
                raise ValueError(
                    f"sample {self.index}: {name} has {len(getattr(self, name))} entries for a response of "
                    f"{self.response_length} tokens; set it to None (or one entry per response token) first"
                )
        self.tokens = self.tokens + tokens
        # in place, as slime's: a plug-in holding the list (retool's ``loss_masks = sample.loss_mask``) sees it grow
        self.loss_mask += [int(trainable)] * len(tokens)
        self.rollout_log_probs += log_probs
        self.response_length += len(tokens)
        if text is not None:
            self.response += text
        finish = (meta_info or {}).get("finish_reason")
        if update_terminal_info and finish is not None:
            self.status = Status.from_finish_reason(
                finish.get("type") if isinstance(finish, dict) else finish
            )

    def mark_failed(self, reason: str) -> None:
        """Set FAILED with a human-readable reason (the batch goes on without this sample's reward)."""
        self.status = Status.FAILED
        self.failure_reason = reason

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (status as its string value, routed experts as base64 ``.npy``), with the
        slime-only fields that were set on this sample."""
        data = dataclasses.asdict(self)
        data.update({k: v for k, v in vars(self).items() if k in SLIME_ONLY_FIELDS})
        data["status"] = self.status.value
        if self.rollout_routed_experts is not None:
            data["rollout_routed_experts"] = routed_experts.encode(self.rollout_routed_experts)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Inverse of :meth:`to_dict`, also reading slime's ``Sample.to_dict`` (its fields vime has no use for are
        kept as attributes and written back by :meth:`to_dict`; its routed experts as nested lists or a tensor);
        other unknown keys raise so that mismatched files are noticed."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known - set(SLIME_ONLY_FIELDS)
        if unknown:
            raise ValueError(
                f"unknown Sample fields {sorted(unknown)}; known fields are {sorted(known)} and slime's "
                f"{sorted(SLIME_ONLY_FIELDS)}"
            )
        fields = {k: v for k, v in data.items() if k in known}
        fields["status"] = Status(fields.get("status", Status.PENDING.value))
        fields["rollout_routed_experts"] = routed_experts.decode(fields.get("rollout_routed_experts"))
        sample = cls(**fields)
        for key in data.keys() & SLIME_ONLY_FIELDS.keys():
            setattr(sample, key, data[key])
        return sample


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
