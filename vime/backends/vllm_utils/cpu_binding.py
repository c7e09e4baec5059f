"""CPU engines sharing a machine each compute on their own cores.

vLLM's CPU worker binds its OpenMP threads to the cores that ``VLLM_CPU_OMP_THREADS_BIND`` names. Its default
(``auto``) picks NUMA node 0's cores less one for the front end, the same cores in every engine. Two engines on
one machine would then compute on the same cores, taking turns, while the others idle.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_bind_env(
    share: tuple[int, int] | None,
    tensor_parallel: int = 1,
    cpus: Sequence[int] | None = None,
    environ: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """``{BIND_ENV: ...}`` for engine ``index`` of ``count`` CPU engines on this machine (``share``).

    The engine takes a contiguous slice of ``cpus`` (default: this process's CPU affinity), split into one list
    per tensor-parallel rank (``"0,1|2,3"``). With more engines than CPUs, engines share CPUs round-robin.
    Empty (vLLM chooses) without a share, for a single engine, when the user set the variable, or when the slice
    has fewer CPUs than ranks.
    """
    if share is None or share[1] <= 1 or BIND_ENV in environ:
        return {}
    index, count = share
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if count > len(cpus):
        mine = [cpus[index % len(cpus)]]
    else:
        mine = cpus[index * len(cpus) // count : (index + 1) * len(cpus) // count]
    if len(mine) < tensor_parallel:
        return {}
    ranks = [
        mine[r * len(mine) // tensor_parallel : (r + 1) * len(mine) // tensor_parallel]
        for r in range(tensor_parallel)
    ]
    return {BIND_ENV: "|".join(",".join(map(str, rank)) for rank in ranks)}
