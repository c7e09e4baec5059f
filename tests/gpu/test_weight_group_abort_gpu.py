"""The streamed ``distributed`` receive leaves a sync the trainer gave up, on NCCL (issue 24): three processes on three
GPUs form the weight group (rank 0 the trainer's sender, ranks 1 and 2 engine workers running the real
``receive_weights_stream``). One whole sync; then rank 2 dies mid-sync, which leaves NCCL's collectives pending
forever, and rank 0 closes the group (``WeightGroup.close``: the store's abort key, then ``ncclCommAbort``). Rank 1
must leave its call at once with ``aborted`` (not at the group's timeout), rank 0's close must return, and both must
then sync whole in a new group, every tensor arriving bit-exact. What the CPU e2e tests cannot show: the NCCL side
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
    pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 CUDA GPUs"),
]
REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("weight_group_abort_worker.py")
DIED = 17  # weight_group_abort_worker.DIED
LEAVE_S = 2.0  # the receivers poll the abort key every 10 ms


def _start(rank: int, tmp_path: Path, *flags: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": str(rank),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, str(WORKER), "--rank", str(rank), "--backend", "nccl", *flags],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / f"rank{rank}.log", "w"),  # noqa: SIM115 (the child holds it)
        text=True,
    )


def _events(stdout: str) -> dict[int, dict]:
    return {event["sync"]: event for event in map(json.loads, stdout.splitlines()) if "sync" in event}


def test_a_receiver_leaves_a_sync_the_trainer_gave_up_and_syncs_whole_in_the_next_group(tmp_path):
    gone = tmp_path / "rank2_gone"
    sender = _start(0, tmp_path, "--rank2-gone", str(gone))
    ports = json.loads(sender.stdout.readline())["ports"]
    receivers = [_start(rank, tmp_path, "--ports", *map(str, ports)) for rank in (1, 2)]
    procs = [sender, *receivers]
    try:
        died = receivers[1].wait(timeout=180)
        gone.touch()
        outputs = [proc.communicate(timeout=120)[0] for proc in (sender, receivers[0])]
    finally:
        for proc in procs:
            proc.kill()
    logs = "".join(f"\n== rank {r}\n{(tmp_path / f'rank{r}.log').read_text()[-3000:]}" for r in range(3))
    assert died == DIED, f"rank 2 did not die at its load in sync 2 (exit {died})" + logs
    assert [sender.returncode, receivers[0].returncode] == [0, 0], logs
    sent, received = _events(outputs[0]), _events(outputs[1])

    first = received[1]
    assert {"receive_s", "load_s"} <= first["answer"].keys(), first["answer"]
    assert first["loaded"] == sent[1]["expected"]

    closed, left = sent[2], received[2]
    assert not closed["completed"], "sync 2 ended although rank 2 died in it: nothing was aborted"
    assert "rank 2 died mid-sync" in left["answer"].get("aborted", ""), left["answer"]
    leave_s = left["returned"] - closed["key_set"]
    assert leave_s < LEAVE_S, f"rank 1 left the given-up sync {leave_s:.2f} s after the abort key was set"
    assert closed["close_s"] < 10, (
        f"rank 0's close (ncclCommAbort with kernels in flight) took {closed['close_s']} s"
    )

    third = received[3]
    assert {"receive_s", "load_s"} <= third["answer"].keys(), third["answer"]
    assert third["loaded"] == sent[3]["expected"]
    print(
        f"\n[weight group abort, nccl] rank 1 left {leave_s * 1e3:.0f} ms after the abort key; rank 0's close "
        f"{closed['close_s'] * 1e3:.0f} ms; sync 1 receive {first['answer']['receive_s']:.3f} s, "
        f"sync 3 receive {third['answer']['receive_s']:.3f} s ({len(third['loaded'])} buckets, bit-exact)"
    )
