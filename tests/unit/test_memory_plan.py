"""The micro-batch memory plan: the line through two probe peaks, the optimizer state still to come, the fix."""

import argparse

import pytest
import torch

from vime.utils.memory_plan import (
    GIB,
    MemoryProbe,
    plan_memory,
    planned_micro_batch_tokens,
    unallocated_optimizer_state_bytes,
)


def test_plan_extrapolates_the_probe_line_and_adds_missing_optimizer_state():
    # 10 GiB at 1000 tokens, 12 GiB at 2000: 2 GiB per 1000 tokens; 4000 tokens -> 16 GiB, +3 GiB of Adam moments
    plan = plan_memory(
        MemoryProbe(1000, 10 * GIB), MemoryProbe(2000, 12 * GIB), 4000, 8 * GIB, 3 * GIB, 20 * GIB
    )
    assert plan.predicted_peak_bytes == 19 * GIB
    assert plan.activation_bytes == 8 * GIB  # 19 - 8 resident - 3 optimizer state
    assert plan.fits
    # room above the 1000-token point: 20 - 13 = 7 GiB at 2 GiB / 1000 tokens -> 4500 tokens
    assert plan.max_fitting_tokens == 4500


def test_plan_that_does_not_fit_says_how_many_tokens_would():
    plan = plan_memory(MemoryProbe(1000, 10 * GIB), MemoryProbe(2000, 12 * GIB), 8000, 8 * GIB, 0, 20 * GIB)
    assert plan.predicted_peak_bytes == 24 * GIB and not plan.fits
    assert plan.max_fitting_tokens == 6000
    assert "8000 tokens" in plan.summary() and "6000 tokens fit" in plan.summary()


def test_plan_needs_two_probe_sizes():
    with pytest.raises(ValueError, match="two sizes"):
        plan_memory(MemoryProbe(1000, 1), MemoryProbe(1000, 2), 4000, 0, 0, 10)


def test_unallocated_optimizer_state_counts_adam_moments_of_params_without_state():
    a, b = torch.nn.Parameter(torch.zeros(10)), torch.nn.Parameter(torch.zeros(6, dtype=torch.float64))
    adam = torch.optim.AdamW([a, b])
    assert unallocated_optimizer_state_bytes([adam]) == 2 * (10 * 4 + 6 * 8)
    a.grad = torch.ones(10)
    adam.step()  # a now has its moments; b has none (no grad)
    assert unallocated_optimizer_state_bytes([adam]) == 2 * 6 * 8
    assert unallocated_optimizer_state_bytes([torch.optim.SGD([b], lr=0.1, momentum=0.9)]) == 6 * 8
    assert unallocated_optimizer_state_bytes([torch.optim.SGD([b], lr=0.1)]) == 0


def test_planned_micro_batch_tokens():
    args = argparse.Namespace(
        use_dynamic_batch_size=True, micro_batch_size=2, rollout_max_context_len=None,
        rollout_max_prompt_len=None, rollout_max_response_len=100,
    )  # fmt: skip
    assert planned_micro_batch_tokens(args, 8192) == 8192
    args.use_dynamic_batch_size = False
    assert planned_micro_batch_tokens(args, None) is None  # prompt length unbounded
    args.rollout_max_prompt_len = 28
    assert planned_micro_batch_tokens(args, None) == 2 * 128
    args.rollout_max_context_len = 64
    assert planned_micro_batch_tokens(args, None) == 2 * 64
