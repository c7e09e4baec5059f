"""Per-micro-batch code that must not make the host wait for the GPU (a wait there drains the launch queue every
micro-batch: 89 ms per 30B-A3B step in `bench/trainer_throughput.py --profile` before the loss reduction stopped
copying its lengths to the GPU)."""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import vime
from vime.utils.ppo_utils import reduce_token_loss

VIME_PACKAGE = str(Path(vime.__file__).resolve().parent)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@contextmanager
def syncs_are_errors():
    """Inside: any CUDA call that makes the host wait raises (the inputs are built before, outside)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_per_sample_loss_reduction_does_not_wait_for_the_gpu():
    per_token = torch.arange(10, dtype=torch.float32, device="cuda")
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0, 0, 1], dtype=torch.float32, device="cuda")
    with syncs_are_errors():
        loss = reduce_token_loss(per_token, mask, [3, 7], False, global_num_samples=2, global_num_tokens=7)
    # sample 0: (0 + 1) / 2; sample 1: (3 + 4 + 5 + 6 + 9) / 5; summed over 2 samples
    assert loss.item() == pytest.approx((0.5 + 27 / 5) / 2)


def test_the_gradient_norm_megatron_gets_does_not_wait_per_parameter():
    pytest.importorskip("megatron.core")
    from megatron.core.utils import local_multi_tensor_l2_norm

    from vime.backends.megatron_utils.grad_norm import foreach_l2_norm

    grads = [torch.randn(n, device="cuda") for n in (4096, 37, 1 << 20)]
    with syncs_are_errors():
        norm, _ = foreach_l2_norm(2048 * 32, None, [grads], False)
    looped, _ = local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)  # Megatron-Core's own fallback
    assert norm.item() == pytest.approx(looped.item(), rel=1e-5)


def _vime_syncs(step) -> Counter:
    """Where in vime's own code ``step()`` makes the host wait for the GPU: (file, line) -> times."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return Counter(
        f"{Path(w.filename).name}:{w.lineno}"
        for w in caught
        if "synchronizing" in str(w.message) and str(Path(w.filename).resolve()).startswith(VIME_PACKAGE)
    )


def test_a_megatron_train_step_waits_no_more_often_with_more_micro_batches(tmp_path):
    """vime's micro-batch path (layout, attention blocks, loss inputs, loss metrics) makes no host wait per
    micro-batch: the same samples in 6 micro-batches wait where they wait in one, as often."""
    pytest.importorskip("megatron.core")
    sys.path.insert(0, str(Path(__file__).parent))
    from test_megatron_gpu import build_moe, make_args, samples_for_test

    from vime.backends.megatron_utils.trainer import MegatronTrainer

    build_moe(tmp_path)
    trainer = MegatronTrainer(make_args(tmp_path, "--optimizer", "sgd", "--advantage-estimator", "grpo"))
    samples, rewards = samples_for_test(), [1.0, -1.0] * 3
    trainer.train(0, samples, rewards)  # warm-up
    syncs = {}
    for micro_batch_size in (6, 1):
        trainer.args.micro_batch_size = micro_batch_size
        syncs[micro_batch_size] = _vime_syncs(lambda: trainer.train(0, samples, rewards))
    grown = {site: (syncs[6][site], n) for site, n in syncs[1].items() if n > syncs[6][site]}
    print(f"[host syncs] one micro-batch: {dict(syncs[6])}; six: {dict(syncs[1])}")
    assert not grown, f"vime waits for the GPU once more per micro-batch at (1 vs 6 micro-batches): {grown}"
