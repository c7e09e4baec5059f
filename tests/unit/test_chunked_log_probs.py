"""``chunked_log_probs``: the same log-probs, entropies and gradients as autograd through ``log_softmax`` (fp64
reference), whatever the chunking, with vocabulary padding and a temperature, on the whole vocabulary or split over
two tensor-parallel ranks (gloo); nothing of size ``[tokens, vocab]`` is kept for backward but the logits, and at any
moment at most two fp32 ``[chunk, vocab]`` temporaries (and a bool mask with the entropy) are alive."""

from __future__ import annotations

import os
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vime.utils import fused_log_probs
from vime.utils.chunked_log_probs import chunked_log_probs

N, V, TRUE_V, T = 11, 24, 21, 0.7  # the last 3 columns are padding
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # test_fused_log_probs.py: the kernels on CPU


@pytest.fixture(autouse=True)
def _several_kernel_blocks_per_row(monkeypatch):
    if INTERPRETED:
        monkeypatch.setattr(fused_log_probs, "BLOCK", 8)


def inputs(dtype=torch.float32, true_v=TRUE_V):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(N, V, generator=g)).to(dtype)
    labels = torch.randint(0, true_v, (N,), generator=g)
    weights = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return logits, labels, weights


def reference(logits, labels, weights, temperature=T, true_v=TRUE_V):
    z = logits.detach().double()[:, :true_v].requires_grad_()
    log_p = torch.log_softmax(z / temperature, dim=-1)
    log_probs = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    (weights[0].double() @ log_probs + weights[1].double() @ entropy).backward()
    grad = torch.zeros(N, V, dtype=torch.float64)
    grad[:, :true_v] = z.grad
    return log_probs, entropy, grad


@pytest.mark.parametrize("temperature", [T, 1.0])  # 1.0: no division pass at all
@pytest.mark.parametrize("chunk_size", [-1, 1, 4, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_log_softmax_values_and_gradients(chunk_size, dtype, temperature):
    logits, labels, weights = inputs(dtype)
    want_lp, want_h, want_grad = reference(logits, labels, weights, temperature)
    x = logits.clone().requires_grad_()
    before = x.detach().clone()
    log_probs, entropy = chunked_log_probs(
        x,
        labels,
        temperature,
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
    assert torch.equal(x.detach(), before)  # the logits themselves are never written


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


class _LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by the storages that ops allocate while it is on (a storage counts until the
    last tensor on it dies): CPU's stand-in for ``torch.cuda.max_memory_allocated``."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _free(self, ptr: int) -> None:
        self.now -= self.live.pop(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {
            a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
        }
        for t in tree_leaves(out):
            ptr = t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else 0
            if ptr and ptr not in seen and ptr not in self.live:  # a new storage, not an alias of an input
                self.live[ptr] = t.untyped_storage().nbytes()
                self.now += self.live[ptr]
                self.peak = max(self.peak, self.now)
                weakref.finalize(t, self._free, ptr)
        return out


@pytest.mark.parametrize("with_entropy", [False, True])
def test_at_most_two_fp32_chunks_are_alive(with_entropy, monkeypatch):
    """The GPU test's bound (logits + 1 GiB at 8k x 151,936, chunks of 512) in units of one fp32 chunk: each chunk's
    temporaries are freed before the next chunk's are made (in a loop body they lived on into the next chunk: 3 fp32
    chunks in the forward, 4.25 in the backward with the entropy, measured on an H200 and here)."""
    # one kernel block per row: Triton's interpreter takes minutes over 512 blocks of 8 per row
    if INTERPRETED:
        monkeypatch.setattr(fused_log_probs, "BLOCK", 4096)
    tokens, vocab, chunk = 256, 4096, 32
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(tokens, vocab, generator=g)).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    one_chunk = chunk * vocab * 4
    with _LiveBytes() as mode:
        log_probs, entropy = chunked_log_probs(
            logits, labels, T, with_entropy=with_entropy, entropy_requires_grad=with_entropy, chunk_size=chunk
        )
        forward = mode.peak
        (log_probs.mean() + (entropy.mean() if with_entropy else 0)).backward()
    # two fp32 chunks, with the entropy a bool one too, and the small per-row vectors
    bound = (2 + 0.25 * with_entropy + 0.05) * one_chunk
    assert forward <= bound
    assert mode.peak - logits.numel() * logits.element_size() <= bound  # beyond the logits' gradient


def _tensor_parallel_rank(rank: int, path: str, queue, true_v: int) -> None:
    if INTERPRETED:
        fused_log_probs.BLOCK = 8
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    logits, labels, weights = inputs(true_v=true_v)
    part = V // 2
    x = logits[:, rank * part : (rank + 1) * part].clone().requires_grad_()
    log_probs, entropy = chunked_log_probs(
        x, labels, T, with_entropy=True, entropy_requires_grad=True, chunk_size=4,
        vocab_start=rank * part, true_vocab_size=true_v, group=dist.group.WORLD,
    )  # fmt: skip
    (weights[0] @ log_probs + weights[1] @ entropy).backward()
    # numpy arrays travel by value: a tensor would go through shared memory that its sender must outlive (a rank that
    # exited first failed the test's read with ConnectionResetError under load)
    queue.put((rank, log_probs.detach().numpy(), entropy.detach().numpy(), x.grad.numpy()))
    dist.destroy_process_group()


@pytest.mark.parametrize("true_v", [TRUE_V, V // 2])  # V // 2: the second rank's columns are all padding
def test_tensor_parallel_slices_match_the_whole_vocabulary(tmp_path, true_v):
    want_lp, want_h, want_grad = reference(*inputs(true_v=true_v), true_v=true_v)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [
        ctx.Process(target=_tensor_parallel_rank, args=(r, str(tmp_path / "pg"), queue, true_v))
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    results = {r: [torch.from_numpy(a) for a in rest] for r, *rest in (queue.get(timeout=120) for _ in procs)}
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
