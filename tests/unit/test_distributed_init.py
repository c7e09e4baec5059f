"""``init_distributed`` as Ray's training ranks call it: rank 0 hosts the group's store on its own bound listener, the
other ranks join through ``MASTER_ADDR``/``MASTER_PORT``. torch prefixes the keys of an ``init_method`` store but not
those of a store passed in, so without rank 0 matching that prefix the ranks never found each other (every
multi-rank trainer under ``train.py`` hung in its process-group start; gloo here, NCCL's id exchange on GPUs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vime.utils.net import listen_socket

REPO = Path(__file__).resolve().parents[2]
RANK = """
import os, sys, torch, torch.distributed as dist
from vime.utils.distributed import init_distributed
from vime.utils.net import listen_socket
rank = int(os.environ["RANK"])
listener = listen_socket("127.0.0.1", int(os.environ["MASTER_PORT"])) if rank == 0 else None
init_distributed(timeout_minutes=1, listener=listener)
x = torch.tensor([rank + 1.0])
dist.all_reduce(x)
print("sum", x.item(), flush=True)
dist.destroy_process_group()
"""


def test_ranks_join_rank_0s_own_store(tmp_path):
    probe = listen_socket("127.0.0.1")  # a free port, released for rank 0's listener
    port = probe.getsockname()[1]
    probe.close()
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outputs = []
    for proc in ranks:
        try:
            outputs.append(proc.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            for p in ranks:
                p.kill()
            raise AssertionError("the two ranks did not form a process group within 90 s") from None
    for proc, out in zip(ranks, outputs, strict=True):
        assert proc.returncode == 0 and "sum 3.0" in out, out[-2000:]
