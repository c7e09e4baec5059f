""":mod:`vime.utils.grouped_wgrad`: every expert's weight gradient added into its fp32 ``main_grad``, against an
fp64 reference, with experts of no rows and shapes that are not multiples of the kernel's blocks. The kernel runs on
CPU under Triton's interpreter (a subprocess); the same file runs on a GPU directly."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vime.utils import grouped_wgrad

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
runs_here = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the kernel runs on a GPU, or on CPU under TRITON_INTERPRET=1 (the subprocess test below)",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
COUNTS = [7, 0, 20, 33, 3]  # expert 1 has no rows; 33 rows take three 16-row steps


def _inputs(dtype: torch.dtype, n_out: int = 40, n_in: int = 24):
    g = torch.Generator().manual_seed(0)
    tokens = sum(COUNTS)
    grad_out = torch.randn(tokens, n_out, generator=g).to(DEVICE, dtype)
    x = torch.randn(tokens, n_in, generator=g).to(DEVICE, dtype)
    main_grad = torch.randn(len(COUNTS), n_out, n_in, generator=g).to(DEVICE)
    offs = torch.tensor(COUNTS).cumsum(0).to(DEVICE, torch.int32)
    return grad_out, x, offs, main_grad


def _reference(grad_out, x, main_grad) -> torch.Tensor:
    out, start = main_grad.double().cpu().clone(), 0
    for e, n in enumerate(COUNTS):
        rows = slice(start, start + n)
        out[e] += grad_out[rows].double().cpu().T @ x[rows].double().cpu()
        start += n
    return out


@needs_triton
@runs_here
@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(),
                reason="Triton 3.9's interpreter gets tl.dot of bf16 operands wrong (1e10 off on 16 x 16); GPU only",
            ),
        ),
    ],
)
def test_every_experts_gradient_is_added_into_main_grad(dtype):
    grad_out, x, offs, main_grad = _inputs(dtype)
    expected = _reference(grad_out, x, main_grad)
    untouched = main_grad[1].clone()
    small_blocks = dict(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
    grouped_wgrad.add_weight_grads(grad_out, x, offs, main_grad, **small_blocks)
    tolerance = (
        1e-5 if dtype == torch.float32 else 1e-3
    )  # bf16 products are exact in fp32; the sums differ in order
    torch.testing.assert_close(main_grad.double().cpu(), expected, rtol=tolerance, atol=tolerance)
    assert torch.equal(main_grad[1], untouched)  # an expert without rows: nothing added


@needs_triton
@runs_here
def test_the_default_blocks_cover_a_shape_smaller_than_one_block():
    grad_out, x, offs, main_grad = _inputs(torch.float32, n_out=20, n_in=12)
    expected = _reference(grad_out, x, main_grad)
    grouped_wgrad.add_weight_grads(grad_out, x, offs, main_grad)
    torch.testing.assert_close(main_grad.double().cpu(), expected, rtol=1e-5, atol=1e-5)


@needs_triton
def test_inputs_that_do_not_fit_main_grad_are_refused():
    grad_out, x, offs, main_grad = _inputs(torch.float32)
    with pytest.raises(ValueError, match="do not fit main_grad"):
        grouped_wgrad.add_weight_grads(grad_out[:, :-1], x, offs, main_grad)


def test_only_a_contiguous_fp32_buffer_and_row_major_inputs_are_taken():
    grad_out, x, _, main_grad = _inputs(torch.float32)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    on_its_device = grouped_wgrad.triton is not None and (torch.cuda.is_available() or interpreted)
    assert grouped_wgrad.usable(grad_out, x, main_grad) == on_its_device
    assert not grouped_wgrad.usable(grad_out, x, main_grad.bfloat16())
    assert not grouped_wgrad.usable(grad_out, x, main_grad.transpose(1, 2))
    assert not grouped_wgrad.usable(grad_out.t(), x, main_grad)
    assert not grouped_wgrad.usable(grad_out.bfloat16(), x, main_grad)


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this is the interpreted run")
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="on a GPU the tests above run the compiled kernel; the interpreter is for CPU machines (on the H200 kit, "
    "Triton 3.6's interpreter with NumPy 2.5 stopped on 'only 0-dimensional arrays can be converted to Python "
    "scalars', 2026-11-28)",
)
def test_the_kernel_passes_these_tests_interpreted():
    here = Path(__file__)  # (not test_grouped_linear.py: its bf16 products hit the interpreter's tl.dot bug)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly",
         str(here)],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout


@needs_triton
@runs_here
def test_grouped_linear_adds_the_weight_gradient_with_the_kernel(monkeypatch):
    """The Megatron experts' backward takes the kernel for a weight with an fp32 ``main_grad`` (fp32 operands here:
    the interpreter's bf16 products are wrong), and hands DDP's hook its dummy gradient."""
    from vime.backends.megatron_utils import grouped_linear

    grad_out, x, offs, main_grad = _inputs(torch.float32)
    expected = _reference(grad_out, x, main_grad)
    weight = torch.nn.Parameter(torch.zeros(main_grad.shape, device=DEVICE))
    weight.main_grad, weight.grad_added_to_main_grad = main_grad, False
    calls, kernel = [], grouped_wgrad.add_weight_grads
    monkeypatch.setattr(grouped_wgrad, "add_weight_grads", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    dummy = grouped_linear._weight_grad(grad_out, x, weight, offs)
    assert calls == [1] and weight.grad_added_to_main_grad and dummy.shape == weight.shape
    torch.testing.assert_close(main_grad.double().cpu(), expected, rtol=1e-5, atol=1e-5)
