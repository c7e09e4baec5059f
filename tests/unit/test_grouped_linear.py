"""grouped_linear (the MoE experts' grouped GEMM with fused weight-gradient accumulation) against a per-expert loop,
on plain weights and on weights emulating Megatron DDP's main_grad buffer and backward hook. On CPU, and on CUDA
where there is one (the GPU command in tests/gpu/test_megatron_gpu.py's grouped test runs this file too)."""

import pytest
import torch

from vime.backends.megatron_utils.grouped_linear import grouped_linear, grouped_mm

pytestmark = pytest.mark.skipif(grouped_mm is None, reason="torch without grouped_mm")

TOKENS = [3, 0, 5, 4]  # expert 1 gets no tokens
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _offs(device: str) -> torch.Tensor:
    return torch.cumsum(torch.tensor(TOKENS), 0, dtype=torch.int32).to(device)


def _weights(out_features: int, in_features: int, device: str) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shape = (out_features, in_features)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).bfloat16().to(device)) for _ in TOKENS]


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


def _reference(x: torch.Tensor, grad_out: torch.Tensor, weights: list[torch.Tensor]):
    """Output, input gradient and weight gradients of the per-expert loop, in fp32."""
    x = x.float().requires_grad_()
    ws = [w.detach().float().requires_grad_() for w in weights]
    out = torch.cat([rows @ w.t() for rows, w in zip(x.split(TOKENS), ws, strict=True)])
    out.backward(grad_out.float())
    return out.detach(), x.grad, [w.grad for w in ws]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected, atol=0.1, rtol=0.02)


def _forward_backward_as_the_loop(x, grad_out, weights, device) -> list[torch.Tensor]:
    """Run ``grouped_linear`` forward and backward (the allocator poisoned first), check its output and input
    gradient against the per-expert loop's, and return the loop's weight gradients."""
    out_ref, grad_x_ref, grads_ref = _reference(x, grad_out, weights)
    x = x.requires_grad_()
    _poison_allocator(device)
    out = grouped_linear(x, weights, _offs(device))
    out.backward(grad_out)
    _close(out, out_ref)
    _close(x.grad, grad_x_ref)
    return grads_ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_features,out_features", [(16, 8), (8, 16)])
def test_plain_weights_get_the_loops_gradients(in_features, out_features, device):
    weights = _weights(out_features, in_features, device)
    x, grad_out = _inputs(in_features, out_features, 1, device)
    grads_ref = _forward_backward_as_the_loop(x, grad_out, weights, device)
    for w, ref in zip(weights, grads_ref, strict=True):
        assert w.grad.dtype == w.dtype and w.grad.shape == w.shape
        _close(w.grad, ref)
    assert torch.count_nonzero(weights[1].grad) == 0  # the expert without tokens


def _megatron_ddp(weights: list[torch.nn.Parameter], storages: list[int]) -> list:
    """Emulate Megatron DDP (overlap_grad_reduce on): main_grads are views of one fp32 buffer in reverse parameter
    order, and a hook after each parameter's AccumulateGrad asserts a grad, adds it unless grad_added_to_main_grad
    is set, then drops it (distributed_data_parallel.py, _make_backward_post_hook); it notes in ``storages`` where
    each grad lives. Returns the AccumulateGrad nodes, which the caller keeps alive (as DDP does) for the hooks."""
    numel = weights[0].numel()
    buffer = torch.zeros(len(weights) * numel, device=weights[0].device)
    grad_accs = []
    for i, w in enumerate(reversed(weights)):
        w.main_grad = buffer[i * numel : (i + 1) * numel].view(w.shape)
        w.grad_added_to_main_grad = False

        def hook(*_, w=w):
            assert w.grad is not None, "param.grad being None is not safe when overlap_grad_reduce is True"
            storages.append(w.grad.untyped_storage().data_ptr())
            if not w.grad_added_to_main_grad:
                w.main_grad.add_(w.grad.data)
            w.grad = None

        grad_accs.append(w.expand_as(w).grad_fn.next_functions[0][0])
        grad_accs[-1].register_hook(hook)
    return grad_accs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_features,out_features", [(16, 8), (8, 16)])
def test_main_grads_accumulate_over_micro_batches(in_features, out_features, device):
    weights = _weights(out_features, in_features, device)
    storages = []
    grad_accs = _megatron_ddp(weights, storages)  # noqa: F841 (kept alive)
    expected = [torch.zeros(w.shape, device=device) for w in weights]
    for seed in (1, 2):
        storages.clear()
        x, grad_out = _inputs(in_features, out_features, seed, device)
        grads_ref = _forward_backward_as_the_loop(x, grad_out, weights, device)
        # AccumulateGrad took the dummies as they are (views of one buffer), without a copy each
        assert len(storages) == len(weights) and len(set(storages)) == 1
        for w, total, ref in zip(weights, expected, grads_ref, strict=True):
            total += ref
            assert w.grad is None and w.grad_added_to_main_grad
            assert w.main_grad.dtype == torch.float32
            _close(w.main_grad, total)
    assert torch.count_nonzero(weights[1].main_grad) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_main_grads_without_ddp_hook_state_get_no_autograd_gradient(device):
    """Megatron's convention: a weight with main_grad but no grad_added_to_main_grad (not under DDP) gets None."""
    weights = _weights(8, 16, device)
    for w in weights:
        w.main_grad = torch.zeros(w.shape, device=device)
    x, grad_out = _inputs(16, 8, 3, device)
    _, _, grads_ref = _reference(x, grad_out, weights)
    grouped_linear(x, weights, _offs(device)).backward(grad_out)
    for w, ref in zip(weights, grads_ref, strict=True):
        assert w.grad is None
        _close(w.main_grad, ref)
