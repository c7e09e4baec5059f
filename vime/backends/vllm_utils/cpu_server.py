"""vLLM's OpenAI server on a machine without a GPU, its engine core forked instead of spawned.

``python -m vime.backends.vllm_utils.cpu_server ARGS...`` runs ``python -m vllm.entrypoints.openai.api_server ARGS...``
with one change: vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` for every server, so the engine core
process imports vLLM again from scratch (about a third of an engine's start: 6 of 18 s of CPU for the tiny test
model). vLLM forks its engine core on GPU machines whenever nothing in the server needs spawn (no CUDA context, not a
Ray actor), and a CPU server has neither, so here vLLM's own default stands and the core starts with the server's
imports in place. A method the user set in the environment is kept.
"""

from __future__ import annotations

import os
import runpy

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def keep_fork() -> None:
    """After vLLM's CPU platform has adjusted the config (and set ``spawn``), put back ``fork``, unless the user
    chose a method."""
    if METHOD_ENV in os.environ:
        return
    from vllm.platforms.cpu import CpuPlatform

    adjust = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        adjust(cls, vllm_config)
        os.environ[METHOD_ENV] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


if __name__ == "__main__":
    keep_fork()
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)
