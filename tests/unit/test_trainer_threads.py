"""``cpu_optimizer_threads``: a training rank runs torch on Ray's one thread, unless its optimizer steps run on the
host (``--optimizer-cpu-offload``): then on its share of the node's cores, unless ``--train-env-vars`` says."""

from __future__ import annotations

import argparse

from vime.ray.train_group import cpu_optimizer_threads


def _args(offload: bool, gpus_per_node: int = 8, env: dict | None = None) -> argparse.Namespace:
    return argparse.Namespace(
        optimizer_cpu_offload=offload, num_gpus_per_node=gpus_per_node, train_env_vars=env or {}
    )


def test_only_a_host_optimizer_gets_more_than_rays_one_thread():
    assert cpu_optimizer_threads(_args(False), 128) is None
    assert cpu_optimizer_threads(_args(True, 8), 128) == 16
    assert cpu_optimizer_threads(_args(True, 4), 64) == 16
    assert cpu_optimizer_threads(_args(True, 8), 4) == 1  # never 0
    assert cpu_optimizer_threads(_args(True, env={"OMP_NUM_THREADS": "6"}), 128) is None  # the user's setting
    assert (
        cpu_optimizer_threads(argparse.Namespace(train_env_vars={}, num_gpus_per_node=8), 128) is None
    )  # FSDP
