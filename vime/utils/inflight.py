"""In-flight weight updates (``--flush-cache-interval``): which syncs are full refreshes (the flag's parse-time checks
are :func:`vime.utils.serving_flags.check_flush_cache_interval`).

With the flag a weight sync pauses the engines in place (``/pause?mode=keep``): a request in flight keeps its KV cache
and finishes on the new weights, so one response may be sampled by several weight versions. The engines label their
weights with the version (vLLM's ``/update_weight_version``) and report, per request, which output tokens each
label sampled; samples keep that as ``weight_version_spans`` (:mod:`vime.rollout.vllm_generate`). Sync 1 of a run,
and every ``N``-th after it for ``N > 0``, is a full refresh instead: in-flight requests are aborted (a rollout puts
their groups back) and the prefix cache is dropped, so no KV computed by older weights survives it.

Sources: upstream vime's schedule (``vime/utils/weight_sync.py::should_flush_cache`` of vllm-project/vime: "refresh
at startup and every N subsequent syncs; nonpositive preserves KV ... A full refresh aborts requests; other updates
pause them in place") and its argument tests (``N <= 0`` selects the fully-async rollout and is refused with colocated
or sleeping engines and with ``--debug-*-only``). Upstream records one version per request (the one it finished on);
its rollout-scheduling doc and the PipelineRL paper it cites (arXiv 2509.19128) define a response's behaviour policy
token by token, which is what the spans record. Unset, the flag keeps vime's earlier behaviour: syncs pause in place
and a request is stamped with the version it was sent at.
"""

from __future__ import annotations

import argparse

DEFAULT_ROLLOUT = "vime.rollout.vllm_rollout.generate_rollout"
FULLY_ASYNC_ROLLOUT = "vime.rollout.fully_async_rollout.generate_rollout"


def records_token_versions(args: argparse.Namespace) -> bool:
    """Whether the engines label their weights and samples record the version of each token (the flag is set)."""
    return args.flush_cache_interval is not None


def is_full_refresh(interval: int | None, version: int) -> bool:
    """Whether sync ``version`` (1 = a run's first) aborts in-flight requests and drops the prefix cache: sync 1 and,
    for ``interval > 0``, versions ``1 + k * interval``; never without the flag (``interval`` None)."""
    if interval is None:
        return False
    return version == 1 or (interval > 0 and (version - 1) % interval == 0)
