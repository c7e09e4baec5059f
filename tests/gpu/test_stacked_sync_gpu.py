"""Stacked MoE expert sync into a real vLLM engine on GPU (issue 23, item 5).

A bf16 Megatron trainer of a Qwen3-30B-A3B-shaped MoE (2 of its layers: 128 experts top-8, hidden 2048, expert
FFN 768; make_tiny_model's small vocabulary) perturbs its weights and syncs them as ``train.py`` does, experts
stacked, over CUDA IPC (``tensor``, the engine beside the trainer) and, with two GPUs, NCCL (``distributed``, the
engine on the second GPU). After the sync the engine's log-probs of a fixed sequence match the trainer's (before it
they did not), and the engine's log says every stacked tensor was written into its fused-MoE layers directly. The
weights check's checksums (recorded by the sync, on by default) pass; a sync with one byte changed in transit (after
the sender's checksums) is rejected, naming the tensor, and leaves the engine serving the previous weights (issue 24's
corruption test on GPU); colocated, a level-2 sleep and a wake-up of the weights with no sync after it (what would
leave the engine without the trainer's weights) fails the checksums, named.

Run with the full kit (tests/gpu/README.md): ``bash tests/gpu/run.sh tests/gpu/test_stacked_sync_gpu.py``.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (the GPU kit)"),
]
SHAPE = "30b-a3b-2l"
LOGPROB_TOL = 0.05  # mean |engine - trainer| of bf16 log-probs (routing over 128 experts flips a few tokens)
WRITTEN = re.compile(
    r"vime weight sync: (\d+) stacked expert tensors written into fused-MoE layers, (\d+) loaded"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from bench.shapes import shape_flags
    from vime.tools.make_tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("moe") / "model", seed=0, task=None, dtype="bfloat16", **shape_flags(SHAPE)
    )


def run_args(model_dir: Path, transport: str):
    from bench.shapes import trainer_flags
    from vime.utils.arguments import parse_args

    return parse_args(
        trainer_flags("megatron", model_dir) + [
            "--prompt-data", "unused.jsonl", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
            "--num-rollout", "1", "--update-weight-transport", transport, "--vllm-enforce-eager",
            "--vllm-max-model-len", "256", "--vllm-gpu-memory-utilization", "0.3" if transport == "tensor" else "0.8",
            *(["--colocate"] if transport == "tensor" else []),
        ]
    )  # fmt: skip


def corrupt_first_bucket(add_checksums):
    """``add_checksums`` that then flips one bit of the first bucket's first byte (after its checksums were taken)."""
    calls = [0]

    def corrupting(buffer, layout):
        add_checksums(buffer, layout)
        if calls[0] == 0:
            buffer[0] ^= 1
        calls[0] += 1

    return corrupting


@pytest.fixture(scope="module")
def trainer(model_dir):
    from vime.backends.megatron_utils.trainer import MegatronTrainer

    return MegatronTrainer(run_args(model_dir, "tensor"))


@pytest.mark.parametrize("transport", ["tensor", "distributed"])
def test_stacked_sync_matches_the_trainers_log_probs(model_dir, trainer, transport, tmp_path, monkeypatch):
    from bench.weight_sync import EXTENSION, SEQUENCE, engine_log_probs, perturb
    from vime.backends.vllm_utils import weight_transports
    from vime.backends.vllm_utils.control_client import EngineGroup
    from vime.backends.vllm_utils.engine import VLLMEngine
    from vime.backends.vllm_utils.weight_sync import sync_weights_from_trainer
    from vime.backends.vllm_utils.weight_transports import BucketRejected
    from vime.utils.stacked_experts import parse_stacked
    from vime.utils.types import Sample, Status
    from vime.utils.weight_check import compare_checksums

    if transport == "distributed" and torch.cuda.device_count() < 2:
        pytest.skip("the distributed (NCCL) case puts the engine on a second GPU")
    args = run_args(model_dir, transport)
    stacked = [
        n for b in trainer.iter_weight_buckets(1 << 30, stack_experts=True) for n, _ in b if parse_stacked(n)
    ]
    assert len(stacked) == 2 * 2  # w13 and w2 of each of the 2 layers
    log = tmp_path / "engine.log"
    # the engine's GPU as this process numbers it (1: the second; 0: the trainer's own), as the engine must name it
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    index = 1 if transport == "distributed" else 0
    gpu = visible[index] if visible != [""] else str(index)
    sample = Sample(index=0, tokens=SEQUENCE, response_length=len(SEQUENCE) - 1, status=Status.COMPLETED)
    extra = list(EXTENSION)
    if transport == "tensor":
        extra.append("--enable-sleep-mode")  # as colocated runs start it
    with VLLMEngine(args, log_path=log, extra_args=extra, env={"CUDA_VISIBLE_DEVICES": gpu}) as engine:
        engine.wait_ready_sync(900)
        perturb(trainer.module, torch.Generator(device="cuda").manual_seed(1), built=[])
        want = trainer.compute_log_probs([sample])[0]
        stale = float((engine_log_probs(engine.url, str(model_dir)) - want).abs().mean())
        metrics = sync_weights_from_trainer(trainer, 0, args, [engine.url], version=1, disk_dir=None)
        diff = float((engine_log_probs(engine.url, str(model_dir)) - want).abs().mean())
        with EngineGroup([engine.url]) as group:

            def checksums() -> dict:
                return {engine.url: group.run(lambda e: e.collective_rpc("check_weights_checksums"))[0]}

            compare_checksums(checksums(), 1)  # stacked experts in vLLM's layout, as the sync recorded them
            # one byte of the first bucket changed after the sender took its checksums (in transit, over CUDA IPC
            # or NCCL): the engine loads nothing of it, the sync fails naming the tensor, the engine keeps sync 1's
            with monkeypatch.context() as patch:
                patch.setattr(
                    weight_transports, "add_checksums", corrupt_first_bucket(weight_transports.add_checksums)
                )
                with pytest.raises(
                    BucketRejected, match=r"rejected a bucket: weight sync: \S+ .* arrived changed"
                ):
                    sync_weights_from_trainer(trainer, 0, args, [engine.url], version=2, disk_dir=None)
            kept = float((engine_log_probs(engine.url, str(model_dir)) - want).abs().mean())
            sync_weights_from_trainer(trainer, 0, args, [engine.url], version=3, disk_dir=None)
            compare_checksums(checksums(), 3)
            if transport == "tensor":  # weights dropped and woken with no sync after: the check must stop it
                group.run(lambda e: e.sleep(level=2))
                group.run(lambda e: e.wake_up(["weights"]))
                with pytest.raises(RuntimeError, match="worker 0: .* changed since the sync loaded it"):
                    compare_checksums(checksums(), 3)
    print(
        f"\n[{transport}] stacked sync {metrics['weight_sync/gb_per_s']:.1f} GB/s; log-prob diff {diff:.2e} (before: {stale:.2e})"
    )
    assert stale > LOGPROB_TOL, "the perturbation does not show in the log-probs: the check could not fail"
    assert diff < LOGPROB_TOL
    assert kept < LOGPROB_TOL  # the rejected sync changed nothing the engine serves
    written = [tuple(map(int, m)) for m in WRITTEN.findall(log.read_text())]
    # syncs 1 and 3 wrote every stacked tensor directly; sync 2 was rejected at its first bucket
    assert written == [(len(stacked), 0)] * 2, written
