"""slime's ``sglang_*`` argument names that plug-ins read, set at parse time from the vLLM settings they mean.

A plug-in written for slime reads ``args.sglang_server_concurrency`` (its in-flight bound per engine),
``args.sglang_router_ip``/``port`` (where ``/generate`` requests go) or
``args.sglang_enable_deterministic_inference`` or ``args.sglang_tool_call_parser``/``sglang_reasoning_parser`` (vLLM's
parser names, e.g. for :mod:`vime.agent.adapters`); after parsing, each holds the value of vime's flag with that
meaning. The router's address is known here only with ``--vllm-router-ip``/``--vllm-router-port``; a rollout's
plug-ins read the address of the router the run uses through the view of ``args`` they are handed
(:class:`vime.utils.run_context.PluginArgs`).
"""

from __future__ import annotations

import argparse

# slime's name -> the vime flag destination with its meaning
SLIME_ARG_ALIASES = {
    "sglang_server_concurrency": "rollout_concurrency",
    "sglang_router_ip": "vllm_router_ip",
    "sglang_router_port": "vllm_router_port",
    "sglang_enable_deterministic_inference": "rollout_sample_seeds",
    "sglang_tool_call_parser": "vllm_tool_call_parser",
    "sglang_reasoning_parser": "vllm_reasoning_parser",
}


def set_slime_names(args: argparse.Namespace) -> None:
    """Give every name of :data:`SLIME_ARG_ALIASES` the value of its vime flag."""
    for slime_name, dest in SLIME_ARG_ALIASES.items():
        setattr(args, slime_name, getattr(args, dest))
