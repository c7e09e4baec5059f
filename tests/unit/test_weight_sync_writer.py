"""The disk transport's writer: buckets -> HF safetensors files that load back unchanged (no engine)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from vime.backends.vllm_utils.weight_sync import write_hf_safetensors


def test_written_files_load_back_equal_and_replace_old_ones(tmp_path):
    g = torch.Generator().manual_seed(0)
    weights = {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=g),
        "model.norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=g).t(),  # non-contiguous
    }
    (tmp_path / "stale.safetensors").write_bytes(b"old")
    buckets = [[(name, weights[name])] for name in weights]
    nbytes = write_hf_safetensors(iter(buckets), tmp_path)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert [f.name for f in files] == [f"model-{i:05d}.safetensors" for i in range(3)]
    loaded = {name: t for f in files for name, t in load_file(f).items()}
    assert loaded.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype
    assert nbytes == sum(t.numel() * t.element_size() for t in weights.values())
