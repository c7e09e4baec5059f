"""One rank of ``test_weight_group_abort_gpu.py``: rank 0 is the trainer's sender, ranks 1 and 2 are engine workers
(the real ``VimeWorkerExtension.receive_weights_stream``, with loading replaced by a record of what arrived).

Three syncs: (1) all three ranks, whole; (2) rank 2 dies (``os._exit``) at its first load, rank 0 waits until the
test says rank 2 is gone, then gives the sync up (``WeightGroup.close``); (3) ranks 0 and 1 in a new group. Every
rank prints one JSON line per event on stdout; rank 0 first prints the two stores' ports."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from vime.backends.vllm_utils.worker_extension import VimeWorkerExtension, create_weight_group
from vime.utils.net import listen_socket
from vime.utils.weight_buckets import add_checksums, flatten_bucket

BUCKETS = 3
# large enough that no receiver can end a sync whose other receiver is dead (NCCL's FIFOs are smaller)
BUCKET_MB = 64
DIED = 17


def report(**event) -> None:
    print(json.dumps(event), flush=True)


def sync_tensors(sync: int, device: torch.device) -> list[list[tuple[str, torch.Tensor]]]:
    """Sync ``sync``'s buckets: a bf16 and an fp32 tensor each, values that differ by sync and bucket."""
    generator = torch.Generator().manual_seed(sync)
    elements = BUCKET_MB * 2**20 // 2 // 2
    return [
        [
            (f"s{sync}.b{k}.bf16", torch.randn(elements, generator=generator).to(torch.bfloat16).to(device)),
            (f"s{sync}.b{k}.fp32", torch.randn(elements // 2, generator=generator).to(device)),
        ]
        for k in range(BUCKETS)
    ]


def fingerprint(tensors: list[tuple[str, torch.Tensor]]) -> list[list[str]]:
    """Each tensor's name and the SHA-256 of its bytes."""
    return [
        [name, hashlib.sha256(tensor.detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()]
        for name, tensor in tensors
    ]


def send(group, sync: int) -> tuple[list, list]:
    """Start broadcasting sync ``sync`` (header + flat bucket per bucket); the works and the buffers they read."""
    works, buffers = [], []
    for k, bucket in enumerate(sync_tensors(sync, group.device)):
        buffer, layout = flatten_bucket(bucket, group.device)
        add_checksums(buffer, layout)
        works += [*group.send_header({"layout": layout, "nbytes": buffer.numel(), "final": k == BUCKETS - 1})]
        works.append(group.broadcast(buffer))
        buffers.append(buffer)
    return works, buffers


def run_sender(args: argparse.Namespace) -> None:
    listeners = [listen_socket("127.0.0.1") for _ in range(2)]
    report(ports=[sock.getsockname()[1] for sock in listeners])
    group = create_weight_group(
        "127.0.0.1", listeners[0].getsockname()[1], 0, 3, args.backend, 120, listeners[0]
    )
    works, buffers = send(group, 1)
    for work in works:
        work.wait()
    torch.cuda.synchronize() if group.device.type == "cuda" else None
    report(event="sent", sync=1, expected=[fingerprint(b) for b in sync_tensors(1, torch.device("cpu"))])

    works, buffers = send(group, 2)
    gone = Path(args.rank2_gone)
    while not gone.exists():
        time.sleep(0.01)
    completed = all(work.is_completed() for work in works)
    key_set = time.time()
    started = time.perf_counter()
    group.close("rank 2 died mid-sync")
    report(
        event="closed", sync=2, completed=completed, key_set=key_set, close_s=time.perf_counter() - started
    )
    del works, buffers

    group = create_weight_group(
        "127.0.0.1", listeners[1].getsockname()[1], 0, 2, args.backend, 120, listeners[1]
    )
    works, buffers = send(group, 3)
    for work in works:
        work.wait()
    torch.cuda.synchronize() if group.device.type == "cuda" else None
    report(event="sent", sync=3, expected=[fingerprint(b) for b in sync_tensors(3, torch.device("cpu"))])


class RecordingWorker(VimeWorkerExtension):
    """The worker extension with vLLM's model replaced by a record of each loaded bucket."""

    rank = 0  # the rank offset passed to init_weight_update_group is the whole rank

    def __init__(self, die_in_sync: int | None):
        self.die_in_sync = die_in_sync
        self.sync = 0
        self.loaded: list[list] = []

    def _vime_load(self, weights: list[tuple[str, torch.Tensor]], final: bool) -> None:
        if self.sync == self.die_in_sync:
            os._exit(DIED)
        self.loaded.append(fingerprint(weights))

    def receive(self, sync: int) -> None:
        self.sync, self.loaded = sync, []
        answer = self.receive_weights_stream()
        report(event="received", sync=sync, answer=answer, returned=time.time(), loaded=self.loaded)


def run_receiver(args: argparse.Namespace) -> None:
    if args.backend == "nccl":
        torch.cuda.set_device(0)
    worker = RecordingWorker(die_in_sync=2 if args.rank == 2 else None)
    worker.init_weight_update_group("127.0.0.1", args.ports[0], args.rank, 3, args.backend, 120)
    worker.receive(1)
    worker.receive(2)
    worker.init_weight_update_group("127.0.0.1", args.ports[1], args.rank, 2, args.backend, 120)
    worker.receive(3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--backend", choices=["gloo", "nccl"], required=True)
    parser.add_argument("--ports", type=int, nargs=2)
    parser.add_argument("--rank2-gone", help="rank 0: a file the test creates once rank 2 has exited")
    args = parser.parse_args()
    run_sender(args) if args.rank == 0 else run_receiver(args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
