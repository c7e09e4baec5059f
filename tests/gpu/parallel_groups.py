"""Between the trainers one GPU test process builds in turn: Megatron-Core's ``destroy_model_parallel`` only forgets
its groups, and torch keeps each one, with its NCCL communicator's device buffers, until the process ends (about
7 GiB more device memory per case of ``test_megatron_parallel.py`` on 2 x H200, outside torch's cache, until a late
case ran out of memory)."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def release_model_parallel() -> None:
    """Drop the last trainer's Megatron groups and destroy every process group but the default one."""
    gc.collect()  # Megatron DDP's hooks keep a trainer in reference cycles: free it before its groups
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)
    torch.cuda.empty_cache()
