"""One rank of ``test_weight_group_abort_gpu.py``: rank 0 is the trainer's sender, the others engine workers
(the real ``VimeWorkerExtension.receive_weights_stream``, with loading replaced by a record of what arrived).

Three syncs: (1) whole; (2) rank 0 sends two of its three buckets, waits until both receivers have loaded the first,
then gives the sync up (``WeightGroup.close``, as ``DistributedTransport.move`` does when its move fails), leaving the
receivers waiting in a collective that will never end; (3) whole, in a new group. Every rank prints one JSON line per
event on stdout; rank 0 first prints the two stores' ports."""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import sys
import time
from pathlib import Path

import torch

from vime.backends.vllm_utils.worker_extension import VimeWorkerExtension, WeightGroup, create_weight_group
from vime.utils.net import listen_socket
from vime.utils.weight_buckets import add_checksums, flatten_bucket

BUCKETS = 3
# large enough that no receiver can end a sync whose other receiver is dead (NCCL's FIFOs are smaller)
BUCKET_MB = 64


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


def send(group: WeightGroup, sync: int, buckets: int = BUCKETS) -> tuple[list, list]:
    """Start broadcasting the first ``buckets`` of sync ``sync`` (header + flat bucket per bucket); the works and the
    buffers they read."""
    works, buffers = [], []
    for k, bucket in enumerate(sync_tensors(sync, group.device)[:buckets]):
        buffer, layout = flatten_bucket(bucket, group.device)
        add_checksums(buffer, layout)
        works += [*group.send_header({"layout": layout, "nbytes": buffer.numel(), "final": k == BUCKETS - 1})]
        works.append(group.broadcast(buffer))
        buffers.append(buffer)
    return works, buffers


def join(args: argparse.Namespace, listener: socket.socket) -> WeightGroup:
    """Rank 0's member of a new weight group whose store listens on ``listener``."""
    port = listener.getsockname()[1]
    return create_weight_group("127.0.0.1", port, 0, args.world_size, args.backend, 120, listener)


def send_whole(group: WeightGroup, sync: int) -> None:
    """Sync ``sync`` from start to end; then report what the receivers must have loaded."""
    works, _buffers = send(group, sync)
    for work in works:
        work.wait()
    torch.cuda.synchronize() if group.device.type == "cuda" else None
    report(
        event="sent", sync=sync, expected=[fingerprint(b) for b in sync_tensors(sync, torch.device("cpu"))]
    )


def run_sender(args: argparse.Namespace) -> None:
    listeners = [listen_socket("127.0.0.1") for _ in range(2)]
    report(ports=[sock.getsockname()[1] for sock in listeners])
    group = join(args, listeners[0])
    send_whole(group, 1)

    works, buffers = send(group, 2, buckets=2)  # not the final one: the receivers wait for a third
    while not all(Path(f"loaded.2.{rank}").exists() for rank in range(1, args.world_size)):
        time.sleep(0.01)
    time.sleep(0.5)  # bucket 1 arrives, then the receivers wait for bucket 2's header
    key_set = time.time()
    started = time.perf_counter()
    group.close("the trainer's move failed")
    close_s = time.perf_counter() - started
    first = [fingerprint(sync_tensors(2, torch.device("cpu"))[0])]
    report(event="closed", sync=2, key_set=key_set, close_s=close_s, expected=first)
    del works, buffers

    send_whole(join(args, listeners[1]), 3)


class RecordingWorker(VimeWorkerExtension):
    """The worker extension with vLLM's model replaced by a record of each loaded bucket."""

    rank = 0  # the rank offset passed to init_weight_update_group is the whole rank

    def __init__(self, rank: int):
        self.global_rank = rank
        self.sync = 0
        self.loaded: list[list] = []

    def _vime_load(self, weights: list[tuple[str, torch.Tensor]], final: bool) -> None:
        self.loaded.append(fingerprint(weights))
        Path(f"loaded.{self.sync}.{self.global_rank}").touch()  # rank 0 waits for these in sync 2

    def receive(self, sync: int) -> None:
        self.sync, self.loaded = sync, []
        answer = self.receive_weights_stream()
        report(event="received", sync=sync, answer=answer, returned=time.time(), loaded=self.loaded)


def run_receiver(args: argparse.Namespace) -> None:
    if args.backend == "nccl":
        torch.cuda.set_device(0)
    worker = RecordingWorker(args.rank)
    worker.init_weight_update_group("127.0.0.1", args.ports[0], args.rank, args.world_size, args.backend, 120)
    worker.receive(1)
    worker.receive(2)
    worker.init_weight_update_group("127.0.0.1", args.ports[1], args.rank, args.world_size, args.backend, 120)
    worker.receive(3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--backend", choices=["gloo", "nccl"], required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--ports", type=int, nargs=2)
    args = parser.parse_args()
    run_sender(args) if args.rank == 0 else run_receiver(args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
