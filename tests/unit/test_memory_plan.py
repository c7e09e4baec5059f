"""The micro-batch memory plan: the line through two probe peaks, the optimizer state still to come, the optimizer
step's temporaries, the fix."""

import argparse

import pytest
import torch

from vime.utils.memory_plan import (
    GIB,
    MemoryProbe,
    optimizer_step_bytes,
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


def test_the_optimizer_step_sets_the_peak_when_its_temporaries_outweigh_the_activations():
    # activations 1 GiB at 4000 tokens (8 GiB resident, 3 GiB of moments to come); the step copies 2 GiB
    small, large = MemoryProbe(1000, 8 * GIB + GIB // 4), MemoryProbe(2000, 8 * GIB + GIB // 2)
    plan = plan_memory(small, large, 4000, 8 * GIB, 3 * GIB, 20 * GIB, optimizer_step_bytes=2 * GIB)
    assert plan.activation_bytes == GIB and plan.optimizer_step_bytes == 2 * GIB
    assert plan.predicted_peak_bytes == 13 * GIB and plan.fits and plan.step_fits
    assert "optimizer step's temporaries 2.0 GiB" in plan.summary()
    half = plan_memory(small, large, 4000, 8 * GIB, 3 * GIB, 20 * GIB, GIB // 2)
    assert half.predicted_peak_bytes == 12 * GIB  # a half-GiB step: the activations set the peak again


def test_a_step_that_cannot_fit_leaves_no_micro_batch_size_that_would():
    small, large = MemoryProbe(1000, 8 * GIB + GIB // 4), MemoryProbe(2000, 8 * GIB + GIB // 2)
    plan = plan_memory(small, large, 4000, 8 * GIB, 3 * GIB, 12 * GIB, optimizer_step_bytes=2 * GIB)
    assert not plan.fits and not plan.step_fits
    assert plan.max_fitting_tokens == 0


def test_optimizer_step_bytes_counts_the_multi_tensor_copies():
    a, b = torch.nn.Parameter(torch.zeros(10)), torch.nn.Parameter(torch.zeros(6, dtype=torch.float64))
    size = 10 * 4 + 6 * 8
    assert optimizer_step_bytes([torch.optim.AdamW([a, b], foreach=True)]) == size  # sqrt of the 2nd moments
    assert optimizer_step_bytes([torch.optim.Adam([a, b], foreach=True)]) == size
    assert optimizer_step_bytes([torch.optim.AdamW([a, b], foreach=False)]) == 0  # one tensor at a time
    assert optimizer_step_bytes([torch.optim.AdamW([a], fused=True)]) == 0
    assert optimizer_step_bytes([torch.optim.AdamW([a, b])]) == 0  # CPU: torch's default is one at a time
    assert optimizer_step_bytes([torch.optim.SGD([a, b], lr=0.1, weight_decay=0.1, foreach=True)]) == size
    assert optimizer_step_bytes([torch.optim.SGD([a, b], lr=0.1, foreach=True)]) == 0
    assert optimizer_step_bytes([torch.optim.AdamW([a, b], foreach=True)], "cuda") == 0  # none on the GPU


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
