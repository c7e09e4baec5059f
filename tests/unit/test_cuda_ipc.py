"""The ``tensor`` transport's bucket flattening (CPU), and sharing a flattened bucket with another process on
the same GPU through CUDA IPC (skipped without CUDA)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from vime.backends.vllm_utils.cuda_ipc import open_cuda_buffer, share_cuda_buffer
from vime.utils.weight_buckets import ALIGN_BYTES, flatten_bucket, unflatten_bucket


def _bucket() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (
            "model.embed_tokens.weight",
            torch.randn(7, 5, generator=gen, dtype=torch.float32).to(torch.bfloat16),
        ),
        ("model.norm.weight", torch.randn(3, generator=gen)),
        ("router.bias", torch.arange(5, dtype=torch.int64)),
        ("scalar", torch.tensor(2.5, dtype=torch.float16)),
    ]


def test_flatten_then_unflatten_gives_back_every_tensor_exactly():
    bucket = _bucket()
    buffer, layout = flatten_bucket(bucket, torch.device("cpu"))
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    assert all(entry["offset"] % ALIGN_BYTES == 0 for entry in layout)
    restored = unflatten_bucket(buffer, layout)
    assert [name for name, _ in restored] == [name for name, _ in bucket]
    for (_, got), (_, want) in zip(restored, bucket, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_unflattened_tensors_are_views_of_the_buffer():
    buffer, layout = flatten_bucket(_bucket(), torch.device("cpu"))
    restored = dict(unflatten_bucket(buffer, layout))
    buffer.zero_()
    assert not restored["model.norm.weight"].any()


def test_layout_is_plain_json():
    import json

    _, layout = flatten_bucket(_bucket(), torch.device("cpu"))
    assert json.loads(json.dumps(layout)) == layout


def _receiver(shared, layout, queue):
    """Map the shared bucket and report which tensors differ from the sender's (plain names: tensors put on a
    multiprocessing queue would be shared through file descriptors that die with this process)."""
    torch.cuda.set_device(0)
    restored = dict(unflatten_bucket(open_cuda_buffer(shared), layout))
    queue.put(sorted(name for name, want in _bucket() if not torch.equal(restored[name].cpu(), want)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_another_process_on_the_same_gpu_reads_the_shared_bucket():
    buffer, layout = flatten_bucket(_bucket(), torch.device("cuda", 0))
    torch.cuda.synchronize()
    shared = share_cuda_buffer(buffer)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(shared, layout, queue))
    proc.start()
    mismatched = queue.get(timeout=120)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert mismatched == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_a_handle_from_another_gpu_is_refused():
    buffer, _ = flatten_bucket(_bucket(), torch.device("cuda", 0))
    shared = share_cuda_buffer(buffer) | {"gpu": "GPU-not-this-one"}
    with pytest.raises(RuntimeError, match="needs each engine worker on its trainer rank's GPU"):
        open_cuda_buffer(shared)
