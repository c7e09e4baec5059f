"""grouped_linear (one projection of all experts as a grouped GEMM over a stacked ``[E, out, in]`` weight, with fused
weight-gradient accumulation) against a per-expert loop, on a plain weight and on one emulating Megatron DDP's
main_grad buffer and backward hook. On CPU, and on CUDA where there is one (the GPU command in
tests/gpu/test_megatron_gpu.py's grouped test runs this file too)."""

import pytest
import torch

from vime.backends.megatron_utils.grouped_linear import grouped_linear, grouped_mm

pytestmark = pytest.mark.skipif(grouped_mm is None, reason="torch without grouped_mm")

TOKENS = [3, 0, 5, 4]  # expert 1 gets no tokens
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _offs(device: str) -> torch.Tensor:
    return torch.cumsum(torch.tensor(TOKENS), 0, dtype=torch.int32).to(device)


def _weight(out_features: int, in_features: int, device: str) -> torch.nn.Parameter:
    gen = torch.Generator().manual_seed(0)
    stacked = torch.randn(len(TOKENS), out_features, in_features, generator=gen)
    return torch.nn.Parameter(stacked.bfloat16().to(device))


def _inputs(in_features: int, out_features: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(TOKENS), in_features, generator=gen).bfloat16()
    return x.to(device), torch.randn(sum(TOKENS), out_features, generator=gen).bfloat16().to(device)


def _poison_allocator(device: str) -> None:
    """Leave NaNs in CUDA's cached free blocks, so an output the kernel does not write (an expert without tokens)
    shows instead of reading as fresh zeros."""
    if device == "cuda":
        for numel in (64, 256, 1024, 4096):
            torch.full((numel,), float("nan"), device=device)


def _reference(x: torch.Tensor, grad_out: torch.Tensor, weight: torch.Tensor):
    """Output, input gradient and weight gradient of the per-expert ``F.linear`` loop, in fp32."""
    x = x.float().requires_grad_()
    w = weight.detach().float().requires_grad_()
    rows = x.split(TOKENS)
    out = torch.cat([torch.nn.functional.linear(r, w[e]) for e, r in enumerate(rows)])
    out.backward(grad_out.float())
    return out.detach(), x.grad, w.grad


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected, atol=0.1, rtol=0.02)


def _forward_backward_as_the_loop(x, grad_out, weight, device) -> torch.Tensor:
    """Run ``grouped_linear`` forward and backward (the allocator poisoned first), check its output and input
    gradient against the per-expert loop's, and return the loop's weight gradient."""
    out_ref, grad_x_ref, grad_ref = _reference(x, grad_out, weight)
    x = x.requires_grad_()
    _poison_allocator(device)
    out = grouped_linear(x, weight, _offs(device))
    out.backward(grad_out)
    _close(out, out_ref)
    _close(x.grad, grad_x_ref)
    return grad_ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_features,out_features", [(16, 8), (8, 16)])
def test_plain_weight_gets_the_loops_gradient(in_features, out_features, device):
    weight = _weight(out_features, in_features, device)
    x, grad_out = _inputs(in_features, out_features, 1, device)
    grad_ref = _forward_backward_as_the_loop(x, grad_out, weight, device)
    assert weight.grad.dtype == weight.dtype and weight.grad.shape == weight.shape
    _close(weight.grad, grad_ref)
    assert torch.count_nonzero(weight.grad[1]) == 0  # the expert without tokens


def _megatron_ddp(weight: torch.nn.Parameter, seen: list) -> object:
    """Emulate Megatron DDP (overlap_grad_reduce on): main_grad is a contiguous view of an fp32 buffer (behind
    another parameter's part), and a hook after the weight's AccumulateGrad asserts a grad, adds it unless
    grad_added_to_main_grad is set, then drops it (distributed_data_parallel.py, _make_backward_post_hook); each
    call is noted in ``seen``. Returns the AccumulateGrad node, which the caller keeps alive (as DDP does)."""
    numel = weight.numel()
    buffer = torch.zeros(numel + 7, device=weight.device)
    weight.main_grad = buffer[7:].view(weight.shape)
    weight.grad_added_to_main_grad = False

    def hook(*_):
        assert weight.grad is not None, "param.grad being None is not safe when overlap_grad_reduce is True"
        seen.append(weight.grad_added_to_main_grad)
        if not weight.grad_added_to_main_grad:
            weight.main_grad.add_(weight.grad.data)
        weight.grad = None

    grad_acc = weight.expand_as(weight).grad_fn.next_functions[0][0]
    grad_acc.register_hook(hook)
    return grad_acc


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_features,out_features", [(16, 8), (8, 16)])
def test_main_grad_accumulates_over_micro_batches(in_features, out_features, device):
    weight = _weight(out_features, in_features, device)
    seen = []
    grad_acc = _megatron_ddp(weight, seen)  # noqa: F841 (kept alive)
    expected = torch.zeros(weight.shape, device=device)
    for seed in (1, 2):
        x, grad_out = _inputs(in_features, out_features, seed, device)
        expected += _forward_backward_as_the_loop(x, grad_out, weight, device)
        assert weight.grad is None and weight.grad_added_to_main_grad
        assert weight.main_grad.dtype == torch.float32
        _close(weight.main_grad, expected)
        weight.grad_added_to_main_grad = False  # so the next micro-batch has to set it again
    assert seen == [True, True]  # one hook call per micro-batch, and it skipped its own add
    assert torch.count_nonzero(weight.main_grad[1]) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_main_grad_without_ddp_hook_state_gets_no_autograd_gradient(device):
    """Megatron's convention: a weight with main_grad but no grad_added_to_main_grad (not under DDP) gets None."""
    weight = _weight(8, 16, device)
    weight.main_grad = torch.zeros(weight.shape, device=device)
    x, grad_out = _inputs(16, 8, 3, device)
    _, _, grad_ref = _reference(x, grad_out, weight)
    grouped_linear(x, weight, _offs(device)).backward(grad_out)
    assert weight.grad is None
    _close(weight.main_grad, grad_ref)
