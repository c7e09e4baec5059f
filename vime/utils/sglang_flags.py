"""slime's ``--sglang-*`` flags on vime's command line: mapped to the vLLM (or vime) flag with the same meaning, or
refused with the flag to use instead.

slime passes every SGLang server flag as ``--sglang-<flag>``; vime's engines are vLLM servers, whose flags pass as
``--vllm-<flag>``. Before parsing, :func:`translate_sglang_flags` rewrites each mapped ``--sglang-*`` flag into the
flag it means (logging one info line naming it), so the vLLM flag's own parser checks the value and the engines get
it as if the user had typed it; a flag without a vLLM meaning stops the parse with the reason and what to pass
instead. Nothing is ignored silently.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mapping:
    """``--sglang-<flag>`` taking ``nargs`` values (0, 1 or ``"+"``) becomes the tokens ``rewrite(values, argv)``
    returns (default: ``target`` followed by the values); ``note`` says how the meanings line up."""

    target: str
    nargs: int | str = 1
    note: str = ""
    rewrite: Callable[[list[str], Sequence[str]], list[str]] | None = None


def _flag_value(argv: Sequence[str], flag: str, default: str) -> str:
    """The last value given to ``flag`` in ``argv`` (``--flag V`` or ``--flag=V``), else ``default``."""
    value = default
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(flag + "="):
            value = token.split("=", 1)[1]
    return value


def _expert_parallel(values: list[str], argv: Sequence[str]) -> list[str]:
    size = int(values[0])
    engine_gpus = int(_flag_value(argv, "--rollout-num-gpus-per-engine", "1"))
    if size == 1:
        return []
    if size != engine_gpus:
        raise ValueError(
            "vLLM's expert parallelism spans an engine's GPUs "
            f"(--rollout-num-gpus-per-engine {engine_gpus}); give {engine_gpus}, or pass --vllm-enable-expert-parallel "
            "with --rollout-num-gpus-per-engine set to the size you want"
        )
    return ["--vllm-enable-expert-parallel"]


def _chunked_prefill(values: list[str], argv: Sequence[str]) -> list[str]:
    size = int(values[0])
    return ["--vllm-no-enable-chunked-prefill"] if size <= 0 else ["--vllm-max-num-batched-tokens", str(size)]


def _always_on(values: list[str], argv: Sequence[str]) -> list[str]:
    return []


# SGLang parser names whose vLLM parser has another name (the same format)
_PARSER_RENAMES = {"qwen25": "hermes", "deepseek-r1": "deepseek_r1"}


def _vllm_parsers(kind: str) -> set[str] | None:
    """The names of the installed vLLM's reasoning or tool parsers (None when vLLM is not importable)."""
    try:
        if kind == "reasoning":
            from vllm.reasoning import ReasoningParserManager as manager
        else:
            try:
                from vllm.tool_parsers import ToolParserManager as manager
            except ImportError:  # vLLM before 0.30
                from vllm.entrypoints.openai.tool_parsers import ToolParserManager as manager
    except ImportError:
        return None
    return set(
        getattr(manager, "reasoning_parsers", None) or getattr(manager, "tool_parsers", None) or {}
    ) | set(getattr(manager, "lazy_parsers", None) or {})


def _parser(kind: str, flag: str) -> Callable[[list[str], Sequence[str]], list[str]]:
    def rewrite(values: list[str], argv: Sequence[str]) -> list[str]:
        name = _PARSER_RENAMES.get(values[0], values[0])
        known = _vllm_parsers(kind)
        if known is not None and name not in known:
            raise ValueError(
                f"vLLM has no {kind} parser {name!r}; pass vLLM's as {flag} (installed: {', '.join(sorted(known))})"
            )
        return [flag, name]

    return rewrite


# --sglang-<flag> -> its mapping
MAPPED: dict[str, Mapping] = {
    "--sglang-mem-fraction-static": Mapping(
        "--vllm-gpu-memory-utilization",
        note="the engine's share of GPU memory (SGLang's covers weights + KV cache, vLLM's the engine's whole use: "
        "lower it if the engines run out of memory)",
    ),
    "--sglang-server-concurrency": Mapping("--rollout-concurrency", note="in-flight requests per engine"),
    "--sglang-router-ip": Mapping("--vllm-router-ip", note="an existing router's address"),
    "--sglang-router-port": Mapping("--vllm-router-port", note="an existing router's port"),
    "--sglang-router-request-timeout-secs": Mapping(
        "--router-request-timeout-secs", note="the router's timeout for one request"
    ),
    "--sglang-max-running-requests": Mapping("--vllm-max-num-seqs", note="sequences an engine runs at once"),
    "--sglang-chunked-prefill-size": Mapping(
        "--vllm-max-num-batched-tokens",
        note="tokens an engine schedules per step (-1: --vllm-no-enable-chunked-prefill)",
        rewrite=_chunked_prefill,
    ),
    "--sglang-cuda-graph-bs": Mapping(
        "--vllm-cudagraph-capture-sizes", nargs="+", note="CUDA-graph batch sizes"
    ),
    "--sglang-cuda-graph-max-bs": Mapping(
        "--vllm-max-cudagraph-capture-size", note="the largest CUDA-graph batch size"
    ),
    "--sglang-disable-cuda-graph": Mapping("--vllm-enforce-eager", nargs=0, note="no CUDA graphs"),
    "--sglang-disable-radix-cache": Mapping(
        "--vllm-no-enable-prefix-caching", nargs=0, note="no prefix cache"
    ),
    "--sglang-page-size": Mapping("--vllm-block-size", note="tokens per KV-cache page"),
    "--sglang-kv-cache-dtype": Mapping("--vllm-kv-cache-dtype", note="the KV cache's dtype"),
    "--sglang-ep-size": Mapping(
        "--vllm-enable-expert-parallel",
        note="experts spread over the engine's GPUs",
        rewrite=_expert_parallel,
    ),
    "--sglang-expert-parallel-size": Mapping(
        "--vllm-enable-expert-parallel",
        note="experts spread over the engine's GPUs",
        rewrite=_expert_parallel,
    ),
    "--sglang-reasoning-parser": Mapping(
        "--vllm-reasoning-parser",
        note="the same format under vLLM's name",
        rewrite=_parser("reasoning", "--vllm-reasoning-parser"),
    ),
    "--sglang-tool-call-parser": Mapping(
        "--vllm-tool-call-parser",
        note="the same format under vLLM's name",
        rewrite=_parser("tool", "--vllm-tool-call-parser"),
    ),
    "--sglang-enable-metrics": Mapping(
        "(none)", nargs=0, note="vLLM engines always serve Prometheus /metrics", rewrite=_always_on
    ),
}

_DP = (
    "runs SGLang's data-parallel attention inside one engine; vLLM's counterpart (--vllm-data-parallel-size with "
    "--vllm-enable-expert-parallel) multiplies an engine's GPUs, which vime sizes by --rollout-num-gpus-per-engine "
    "alone: drop it (more engines give data parallelism: --rollout-num-gpus)"
)
_DEEPEP = (
    "picks SGLang's MoE all-to-all; in vLLM pass --vllm-all2all-backend (deepep_high_throughput, deepep_low_latency, "
    "...) with --vllm-enable-expert-parallel"
)
_SPECULATIVE = (
    "configures SGLang's speculative decoding; in vLLM pass one JSON, e.g. --vllm-speculative-config "
    '\'{"method": "eagle3", "model": "DRAFT", "num_speculative_tokens": 3}\' (or "method": "mtp" for the '
    "model's own MTP layers)"
)
# --sglang-<flag> -> why it is refused and what to pass instead
REFUSED: dict[str, str] = {
    "--sglang-dp-size": _DP,
    "--sglang-enable-dp-attention": _DP,
    "--sglang-moe-dp-size": _DP,
    "--sglang-enable-dp-lm-head": _DP,
    "--sglang-moe-dense-tp-size": "sets SGLang's tensor-parallel size of dense layers under DP attention; vLLM "
    "has none: drop it",
    "--sglang-deepep-mode": _DEEPEP,
    "--sglang-moe-a2a-backend": _DEEPEP,
    "--sglang-enable-deepep-moe": _DEEPEP,
    "--sglang-speculative-algorithm": _SPECULATIVE,
    "--sglang-speculative-num-steps": _SPECULATIVE,
    "--sglang-speculative-eagle-topk": _SPECULATIVE,
    "--sglang-speculative-num-draft-tokens": _SPECULATIVE,
    "--sglang-speculative-draft-attention-backend": _SPECULATIVE,
    "--sglang-attention-backend": "names an SGLang kernel; vLLM's kernels have other names: pass "
    "--vllm-attention-backend (e.g. FLASH_ATTN, FLASHINFER, TRITON_ATTN)",
    "--sglang-pp-size": "in vLLM pass --vllm-pipeline-parallel-size (vime sizes an engine by "
    "--rollout-num-gpus-per-engine, which must then be tensor x pipeline parallel)",
    "--sglang-pipeline-parallel-size": "in vLLM pass --vllm-pipeline-parallel-size",
    "--sglang-enable-deterministic-inference": "makes SGLang's kernels batch-invariant; vime's "
    "--rollout-sample-seeds gives each request its own seed (vLLM's kernels stay batch-dependent)",
    "--sglang-config": "is slime's multi-model YAML; vime's is --vllm-config (its own format, README)",
    "--sglang-disable-overlap-schedule": "in vLLM pass --vllm-no-async-scheduling",
    "--sglang-watchdog-timeout": "is SGLang's hang watchdog; vime health-checks its engines: "
    "--rollout-health-check-timeout with --use-fault-tolerance",
    "--sglang-max-prefill-tokens": "in vLLM the per-step token budget is --vllm-max-num-batched-tokens",
}

_NEGATIVE_NUMBER = re.compile(r"^-\d")


def translate_sglang_flags(argv: Sequence[str]) -> list[str]:
    """``argv`` with every mapped ``--sglang-*`` flag replaced by the flag it means (one info line each); a refused
    or unknown ``--sglang-*`` flag raises ``ValueError`` with the reason and the flag to use instead."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--sglang-"):
            out.append(token)
            continue
        flag, has_inline, inline = token.partition("=")
        if flag in REFUSED:
            raise ValueError(f"{flag}: vime's engines are vLLM servers; this flag {REFUSED[flag]}")
        mapping = MAPPED.get(flag)
        if mapping is None:
            raise ValueError(
                f"{flag} is an SGLang server flag with no vLLM counterpart known to vime; pass the vLLM server "
                "flag you mean as --vllm-<flag> (list them with --help-vllm)"
            )
        values = [inline] if has_inline else []
        if not has_inline and mapping.nargs != 0:
            while i < len(argv) and (not argv[i].startswith("-") or _NEGATIVE_NUMBER.match(argv[i])):
                values.append(argv[i])
                i += 1
                if mapping.nargs == 1:
                    break
        expected = {0: "no value", 1: "one value"}.get(mapping.nargs, "one or more values")  # type: ignore[arg-type]
        if (mapping.nargs == 0 and values) or (mapping.nargs != 0 and not values):
            raise ValueError(f"{flag} takes {expected} (got {values or 'none'})")
        try:
            tokens = mapping.rewrite(values, argv) if mapping.rewrite else [mapping.target, *values]
        except ValueError as exc:
            raise ValueError(f"{flag} {' '.join(values)}: {exc}") from None
        logger.info(
            "slime's %s%s -> %s (%s)",
            flag,
            "".join(f" {v}" for v in values),
            " ".join(tokens) or "nothing to set",
            mapping.note,
        )
        out += tokens
    return out
