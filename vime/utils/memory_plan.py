"""Will the planned micro-batch fit on the GPU? Checked before the first step, not found out by a CUDA OOM.

A trainer measures the peak memory of a forward/backward pass on two synthetic micro-batches smaller than the
planned one (:class:`MemoryProbe`). Activation memory grows linearly with the tokens of a packed micro-batch
(varlen flash attention keeps no ``tokens²`` scores), so the line through the two peaks, plus the optimizer state
that is only created at the first step, predicts the peak of the planned micro-batch (:func:`plan_memory`). The
optimizer step runs after the activations are gone but adds its own temporaries (:func:`optimizer_step_bytes`): with
few activations (a large vocabulary's logits no longer held, many parameters) the step sets the peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _default_to_fused_or_foreach

GIB = 1024**3


@dataclass(frozen=True)
class MemoryProbe:
    """The peak GPU memory allocated during the forward/backward of a micro-batch of ``tokens`` tokens."""

    tokens: int
    peak_bytes: int


@dataclass(frozen=True)
class MemoryPlan:
    """The predicted peak of a micro-batch of ``tokens`` tokens against the GPU memory this process can use."""

    tokens: int
    predicted_peak_bytes: int
    # weights, optimizer state so far, and the gradients a step keeps (buffered already or created by it)
    resident_bytes: int
    optimizer_state_bytes: int  # optimizer state not allocated yet (created by the first step)
    activation_bytes: int  # the forward/backward's peak above the resident memory
    optimizer_step_bytes: int  # the optimizer step's temporaries (no activations are held then)
    available_bytes: int
    max_fitting_tokens: int

    @property
    def fits(self) -> bool:
        return self.predicted_peak_bytes <= self.available_bytes

    def summary(self) -> str:
        return (
            f"micro-batch of {self.tokens} tokens: predicted peak {self.predicted_peak_bytes / GIB:.1f} GiB "
            f"(weights/gradients/optimizer {(self.resident_bytes + self.optimizer_state_bytes) / GIB:.1f} GiB, "
            f"then the larger of activations {self.activation_bytes / GIB:.1f} GiB and the optimizer step's "
            f"temporaries {self.optimizer_step_bytes / GIB:.1f} GiB) of {self.available_bytes / GIB:.1f} GiB "
            f"available; up to about {self.max_fitting_tokens} tokens fit"
        )

    @property
    def step_fits(self) -> bool:
        """Whether the optimizer step fits at all (no micro-batch size changes it)."""
        return (
            self.resident_bytes + self.optimizer_state_bytes + self.optimizer_step_bytes
            <= self.available_bytes
        )


def plan_memory(
    small: MemoryProbe,
    large: MemoryProbe,
    tokens: int,
    resident_bytes: int,
    optimizer_state_bytes: int,
    available_bytes: int,
    optimizer_step_bytes: int = 0,
) -> MemoryPlan:
    """Extrapolate the two probes' peaks to a micro-batch of ``tokens`` tokens and add the optimizer state the
    first step will allocate; the peak is the larger of that and the optimizer step (resident memory, the whole
    optimizer state and ``optimizer_step_bytes`` of temporaries). ``max_fitting_tokens`` is where the line meets
    ``available_bytes`` (0 when the optimizer step alone does not fit)."""
    if large.tokens <= small.tokens:
        raise ValueError(f"probes need two sizes, got {small.tokens} and {large.tokens} tokens")
    per_token = max(large.peak_bytes - small.peak_bytes, 0) / (large.tokens - small.tokens)
    at_small = small.peak_bytes + optimizer_state_bytes
    pass_peak = at_small + per_token * (tokens - small.tokens)
    step_peak = resident_bytes + optimizer_state_bytes + optimizer_step_bytes
    room = available_bytes - at_small
    if step_peak > available_bytes:
        max_tokens = 0
    elif per_token > 0:
        max_tokens = small.tokens + room / per_token
    else:
        max_tokens = tokens if room >= 0 else 0
    return MemoryPlan(
        tokens=tokens,
        predicted_peak_bytes=int(max(pass_peak, step_peak)),
        resident_bytes=resident_bytes,
        optimizer_state_bytes=optimizer_state_bytes,
        activation_bytes=max(int(pass_peak) - resident_bytes - optimizer_state_bytes, 0),
        optimizer_step_bytes=optimizer_step_bytes,
        available_bytes=available_bytes,
        max_fitting_tokens=max(int(max_tokens), 0),
    )


def unallocated_optimizer_state_bytes(
    optimizers: list[torch.optim.Optimizer], device_type: str | None = None
) -> int:
    """Bytes of optimizer state the first step will create: two moments per parameter for Adam-like optimizers
    (``betas``), one for SGD with momentum, for every parameter that has no state yet (local shards for DTensors);
    with ``device_type``, only for the parameters on that device (a CPU optimizer's state takes no GPU memory)."""
    total = 0
    for inner in optimizers:
        per_param = 2 if "betas" in inner.defaults else 1 if inner.defaults.get("momentum") else 0
        for group in inner.param_groups:
            total += sum(
                per_param * local_bytes(p) for p in _on(group, device_type) if not inner.state.get(p)
            )
    return total


def optimizer_step_bytes(optimizers: list[torch.optim.Optimizer], device_type: str | None = None) -> int:
    """The temporaries of one step of ``optimizers``: torch's multi-tensor (``foreach``) Adam and AdamW take the
    square root of every second moment at once (a copy of the parameters), and SGD with weight decay adds it into
    a copy of the gradients; the fused kernels and the one-tensor-at-a-time loops hold no such copy. With
    ``device_type``, only the parameters on that device count."""
    total = 0
    for inner in optimizers:
        copies = "betas" in inner.defaults or bool(inner.defaults.get("weight_decay"))
        for group in inner.param_groups:
            params = _on(group, device_type)
            if not copies or group.get("fused") or not params:
                continue
            foreach = group.get("foreach")
            if foreach is None:  # torch's default: the multi-tensor path where every parameter supports it
                _, foreach = _default_to_fused_or_foreach(group["params"], bool(group.get("differentiable")))
            if foreach:
                total += sum(local_bytes(p) for p in params)
    return total


def _on(group: dict, device_type: str | None) -> list[torch.Tensor]:
    """The parameters of an optimizer's param ``group`` on ``device_type`` (all of them without one)."""
    return [p for p in group["params"] if not device_type or p.device.type == device_type]


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's part of ``tensor`` (its local shard for a DTensor)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def planned_micro_batch_tokens(args, token_budget: int | None) -> int | None:
    """The most tokens one packed micro-batch can hold: ``token_budget`` (``--max-tokens-per-gpu``) with
    ``--use-dynamic-batch-size``, else ``--micro-batch-size`` samples of the longest possible sample (None when
    the prompt length is unbounded)."""
    if args.use_dynamic_batch_size:
        return token_budget
    longest = args.rollout_max_context_len
    if longest is None and args.rollout_max_prompt_len is not None:
        longest = args.rollout_max_prompt_len + args.rollout_max_response_len
    return args.micro_batch_size * longest if longest else None
