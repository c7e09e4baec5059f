"""Which GPUs each vLLM engine is pinned to (``CUDA_VISIBLE_DEVICES``), from the rollout bundles' GPUs."""

from __future__ import annotations

import argparse

import pytest

from vime.ray.rollout_manager import engine_gpus


def test_consecutive_gpus_per_engine():
    args = argparse.Namespace(rollout_num_gpus_per_engine=2)
    gpus = [("node-a", "4"), ("node-a", "5"), ("node-a", "6"), ("node-a", "7")]
    assert engine_gpus(args, gpus) == ["4,5", "6,7"]
    assert engine_gpus(argparse.Namespace(rollout_num_gpus_per_engine=1), gpus[:2]) == ["4", "5"]


def test_engines_across_nodes_are_refused():
    args = argparse.Namespace(rollout_num_gpus_per_engine=1)
    with pytest.raises(NotImplementedError, match="span 2 Ray nodes"):
        engine_gpus(args, [("node-a", "0"), ("node-b", "0")])
