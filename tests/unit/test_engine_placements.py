"""Where each vLLM engine runs: its bundle, node and GPUs (``CUDA_VISIBLE_DEVICES``), from the rollout bundles'
slots; an engine never spans nodes."""

from __future__ import annotations

import argparse

import pytest

from vime.ray.placement_group import Bundles, BundleSlot, engine_placements


def _bundles(n: int, first: int = 0) -> Bundles:
    return Bundles(group=None, indices=list(range(first, first + n)), resource="GPU")


def test_consecutive_gpus_of_one_node_per_engine():
    args = argparse.Namespace(rollout_num_gpus_per_engine=2)
    slots = [BundleSlot("node-a", "10.0.0.1", gpu) for gpu in ("4", "5", "6", "7")]
    placements = engine_placements(args, _bundles(4, first=4), slots)
    assert [(p.bundle_index, p.node_ip, p.gpus) for p in placements] == [
        (4, "10.0.0.1", "4,5"),
        (6, "10.0.0.1", "6,7"),
    ]


def test_bundles_are_grouped_by_node_and_gpu_unless_colocated():
    """Ray may interleave the bundles of two nodes; engines of 2 GPUs still each get one node."""
    args = argparse.Namespace(rollout_num_gpus_per_engine=2)
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
    args = argparse.Namespace(rollout_num_gpus_per_engine=1)
    slots = [BundleSlot("node-a", "127.0.0.1", None), BundleSlot("node-b", "127.0.0.1", None)]
    placements = engine_placements(args, _bundles(2, first=1), slots)
    assert [(p.bundle_index, p.node_id, p.gpus, p.cpu_share) for p in placements] == [
        (1, "node-a", None, (0, 1)),
        (2, "node-b", None, (0, 1)),
    ]


def test_cpu_engines_of_one_node_split_its_cores_and_gpu_engines_do_not():
    args = argparse.Namespace(rollout_num_gpus_per_engine=1)
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
    args = argparse.Namespace(rollout_num_gpus_per_engine=2)
    slots = [BundleSlot("node-a", "10.0.0.1", "7")] + [BundleSlot("node-b", "10.0.0.2", g) for g in "012"]
    with pytest.raises(ValueError, match="engine 0 would span Ray nodes"):
        engine_placements(args, _bundles(4), slots)


def test_vllm_config_engines_of_several_sizes_and_a_placeholder():
    """--vllm-config: the policy's two 1-GPU engines, a teacher on 2 GPUs, then 2 placeholder GPUs left unused."""
    args = argparse.Namespace(rollout_num_gpus_per_engine=1)
    slots = [BundleSlot("node-a", "10.0.0.1", str(gpu)) for gpu in range(6)]
    placements = engine_placements(args, _bundles(6), slots, sizes=[1, 1, 2])
    assert [(p.bundle_index, p.gpus) for p in placements] == [(0, "0"), (1, "1"), (2, "2,3")]
    with pytest.raises(ValueError, match="3 engines need 7 rollout bundles; there are 6"):
        engine_placements(args, _bundles(6), slots, sizes=[1, 2, 4])
