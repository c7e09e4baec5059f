"""Megatron-Core's gradient norm without TransformerEngine/APEX: torch's multi-tensor norm instead of its loop."""

from __future__ import annotations

import pytest
import torch

from vime.backends.megatron_utils.grad_norm import foreach_l2_norm, use_foreach_grad_norm


def test_the_norm_is_the_l2_norm_of_all_tensors_together():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(100, generator=g), torch.randn(3, 7, generator=g), torch.randn(0)]
    norm, per_tensor = foreach_l2_norm(2048 * 32, torch.zeros(1, dtype=torch.int), [grads], False)
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert norm.item() == pytest.approx(torch.cat([t.flatten() for t in grads]).norm().item(), rel=1e-6)
    bf16 = foreach_l2_norm(0, None, [[t.bfloat16() for t in grads]], False)[0]
    assert bf16.dtype == torch.float32 and bf16.item() == pytest.approx(norm.item(), rel=1e-2)
    with pytest.raises(NotImplementedError, match="per-tensor"):
        foreach_l2_norm(0, None, [grads], True)


def test_megatrons_looping_fallback_is_replaced_once():
    clip_grads = pytest.importorskip("megatron.core.optimizer.clip_grads")
    from megatron.core.utils import local_multi_tensor_l2_norm

    before = clip_grads.l2_norm_impl
    try:
        clip_grads.l2_norm_impl = local_multi_tensor_l2_norm
        assert use_foreach_grad_norm() and clip_grads.l2_norm_impl is foreach_l2_norm
        assert not use_foreach_grad_norm()  # already replaced; a TE/APEX kernel would be kept likewise
    finally:
        clip_grads.l2_norm_impl = before
