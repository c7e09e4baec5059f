"""``chunked_log_probs``: the same log-probs, entropies and gradients as autograd through ``log_softmax`` (fp64
reference), whatever the chunking, with vocabulary padding and a temperature, on the whole vocabulary or split over
two tensor-parallel ranks (gloo); and nothing of size ``[tokens, vocab]`` is kept for backward but the logits."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vime.utils.chunked_log_probs import chunked_log_probs

N, V, TRUE_V, T = 11, 24, 21, 0.7  # the last 3 columns are padding


def inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(N, V, generator=g)).to(dtype)
    labels = torch.randint(0, TRUE_V, (N,), generator=g)
    weights = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return logits, labels, weights


def reference(logits, labels, weights):
    z = logits.detach().double()[:, :TRUE_V].requires_grad_()
    log_p = torch.log_softmax(z / T, dim=-1)
    log_probs = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    (weights[0].double() @ log_probs + weights[1].double() @ entropy).backward()
    grad = torch.zeros(N, V, dtype=torch.float64)
    grad[:, :TRUE_V] = z.grad
    return log_probs, entropy, grad


@pytest.mark.parametrize("chunk_size", [-1, 1, 4, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_log_softmax_values_and_gradients(chunk_size, dtype):
    logits, labels, weights = inputs(dtype)
    want_lp, want_h, want_grad = reference(logits, labels, weights)
    x = logits.clone().requires_grad_()
    log_probs, entropy = chunked_log_probs(
        x,
        labels,
        T,
        with_entropy=True,
        entropy_requires_grad=True,
        chunk_size=chunk_size,
        true_vocab_size=TRUE_V,
    )
    (weights[0] @ log_probs + weights[1] @ entropy).backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(log_probs.double(), want_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), want_h, rtol=0, atol=1e-5)
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad.double(), want_grad, rtol=tol, atol=tol)


def test_entropy_without_grad_and_log_probs_alone():
    logits, labels, weights = inputs()
    _, _, want_grad_lp_only = reference(logits, labels, (weights[0], torch.zeros(N)))
    x = logits.clone().requires_grad_()
    log_probs, entropy = chunked_log_probs(
        x, labels, T, with_entropy=True, chunk_size=3, true_vocab_size=TRUE_V
    )
    assert not entropy.requires_grad
    (weights[0] @ log_probs).backward()
    torch.testing.assert_close(x.grad.double(), want_grad_lp_only, rtol=1e-5, atol=1e-5)
    assert chunked_log_probs(logits, labels, T, true_vocab_size=TRUE_V)[1] is None
    with pytest.raises(ValueError, match="must be > 0"):
        chunked_log_probs(logits, labels, 0.0)


def test_only_the_logits_are_kept_for_backward():
    logits, labels, _ = inputs()
    x = logits.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        log_probs, entropy = chunked_log_probs(x, labels, T, with_entropy=True, entropy_requires_grad=True)
    big = [t for t in saved if t.numel() >= N * V]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr()  # the logits themselves, no fp32 copy


def _tensor_parallel_rank(rank: int, path: str, queue) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    logits, labels, weights = inputs()
    part = V // 2
    x = logits[:, rank * part : (rank + 1) * part].clone().requires_grad_()
    log_probs, entropy = chunked_log_probs(
        x, labels, T, with_entropy=True, entropy_requires_grad=True, chunk_size=4,
        vocab_start=rank * part, true_vocab_size=TRUE_V, group=dist.group.WORLD,
    )  # fmt: skip
    (weights[0] @ log_probs + weights[1] @ entropy).backward()
    queue.put((rank, log_probs.detach(), entropy.detach(), x.grad))
    dist.destroy_process_group()


def test_tensor_parallel_slices_match_the_whole_vocabulary(tmp_path):
    want_lp, want_h, want_grad = reference(*inputs())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [ctx.Process(target=_tensor_parallel_rank, args=(r, str(tmp_path / "pg"), queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict((r, rest) for r, *rest in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for rank, (log_probs, entropy, grad) in results.items():
        torch.testing.assert_close(log_probs.double(), want_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(entropy.double(), want_h, rtol=0, atol=1e-5)
        part = V // 2
        torch.testing.assert_close(
            grad.double(), want_grad[:, rank * part : (rank + 1) * part], rtol=1e-5, atol=1e-5
        )
