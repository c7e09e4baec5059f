"""The streamed ``distributed`` receive leaves a sync the trainer gave up, on NCCL (issue 24): two or three processes,
one per GPU, form the weight group (rank 0 the trainer's sender, the others engine workers running the real
``receive_weights_stream``). One whole sync; then rank 0 sends two of a sync's three buckets and gives it up, as a
failed move does (``WeightGroup.close``: the store's abort key, then ``ncclCommAbort``), leaving the receivers in a
broadcast that will never end. Both must leave their call at once with ``aborted`` (not at the group's timeout),
having loaded only the bucket whose successor arrived, rank 0's close must return, and all must then sync whole
in a new group, every tensor arriving bit-exact. What the CPU e2e tests cannot show: the NCCL side
(aborting a communicator with kernels in flight, and a new one in the same processes after it).

Run with the GPU kit (tests/gpu/README.md): ``bash tests/gpu/run.sh tests/gpu/test_weight_group_abort_gpu.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]
REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("weight_group_abort_worker.py")
BACKEND = "nccl"
WORLD_SIZE = min(3, torch.cuda.device_count())  # the sender and one or two receivers
LEAVE_S = 2.0  # the receivers poll the abort key every 10 ms


def _start(rank: int, tmp_path: Path, *flags: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": str(rank),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [
            sys.executable,
            str(WORKER),
            "--rank",
            str(rank),
            "--backend",
            BACKEND,
            "--world-size",
            str(WORLD_SIZE),
            *flags,
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / f"rank{rank}.log", "w"),  # noqa: SIM115 (the child holds it)
        text=True,
    )


def _events(stdout: str) -> dict[int, dict]:
    return {event["sync"]: event for event in map(json.loads, stdout.splitlines()) if "sync" in event}


def test_receivers_leave_a_sync_the_trainer_gave_up_and_sync_whole_in_the_next_group(tmp_path):
    sender = _start(0, tmp_path)
    ports = json.loads(sender.stdout.readline())["ports"]
    procs = [sender, *(_start(rank, tmp_path, "--ports", *map(str, ports)) for rank in range(1, WORLD_SIZE))]
    try:
        outputs = [proc.communicate(timeout=180)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    logs = "".join(
        f"\n== rank {r}\n{(tmp_path / f'rank{r}.log').read_text()[-3000:]}" for r in range(WORLD_SIZE)
    )
    assert [proc.returncode for proc in procs] == [0] * WORLD_SIZE, logs
    sent, *receivers = map(_events, outputs)
    closed = sent[2]
    for rank, received in enumerate(receivers, 1):
        print(f"rank {rank}", {sync: event["answer"] for sync, event in received.items()})
        for sync in (1, 3):
            assert {"receive_s", "load_s"} <= received[sync]["answer"].keys(), (rank, sync, received[sync])
            assert received[sync]["loaded"] == sent[sync]["expected"], (rank, sync)
        left = received[2]
        assert "the trainer's move failed" in left["answer"].get("aborted", ""), (rank, left["answer"])
        assert left["loaded"] == closed["expected"], (rank, left["loaded"])  # bucket 0 only
        leave_s = left["returned"] - closed["key_set"]
        assert leave_s < LEAVE_S, f"rank {rank} left the given-up sync {leave_s:.2f} s after the abort key"
    assert closed["close_s"] < 10, (
        f"rank 0's close (ncclCommAbort, kernels in flight) took {closed['close_s']} s"
    )
    print(
        f"\n[weight group abort, {BACKEND}] receivers left {leave_s * 1e3:.0f} ms after the abort key; rank 0's close "
        f"{closed['close_s'] * 1e3:.0f} ms; the next group's sync bit-exact ({len(sent[3]['expected'])} buckets)"
    )
