"""slime's ``--sglang-*`` flags (issue 26 item 1): each mapped one parses into the vLLM (or vime) flag with its meaning,
with one info line naming that flag, and reaches the engine's command line; the others stop the parse with the flag
to use instead."""

from __future__ import annotations

import logging

import pytest

from vime.utils.arguments import parse_args
from vime.utils.passthrough_args import passthrough_cli_args
from vime.utils.sglang_flags import MAPPED, REFUSED, translate_sglang_flags

BASE = ["--train-backend", "fsdp", "--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--num-rollout", "1"]  # fmt: skip


def _parse_logged(caplog, *flags):
    with caplog.at_level(logging.INFO, logger="vime.utils.sglang_flags"):
        args = parse_args([*BASE, *flags])
    return args, [r.getMessage() for r in caplog.records if r.name == "vime.utils.sglang_flags"]


@pytest.mark.parametrize(
    ("flags", "dest", "value", "vllm_flag"),
    [
        (["--sglang-mem-fraction-static", "0.7"], "vllm_gpu_memory_utilization", 0.7, "--vllm-gpu-memory-utilization"),
        (["--sglang-server-concurrency", "64"], "rollout_concurrency", 64, "--rollout-concurrency"),
        (["--sglang-max-running-requests", "128"], "vllm_max_num_seqs", 128, "--vllm-max-num-seqs"),
        (["--sglang-chunked-prefill-size", "4096"], "vllm_max_num_batched_tokens", 4096, "--vllm-max-num-batched-tokens"),
        (["--sglang-chunked-prefill-size", "-1"], "vllm_enable_chunked_prefill", False, "--vllm-no-enable-chunked-prefill"),
        (["--sglang-cuda-graph-bs", "1", "2", "4"], "vllm_cudagraph_capture_sizes", [1, 2, 4], "--vllm-cudagraph-capture-sizes"),
        (["--sglang-cuda-graph-max-bs", "256"], "vllm_max_cudagraph_capture_size", 256, "--vllm-max-cudagraph-capture-size"),
        (["--sglang-disable-cuda-graph"], "vllm_enforce_eager", True, "--vllm-enforce-eager"),
        (["--sglang-disable-radix-cache"], "vllm_enable_prefix_caching", False, "--vllm-no-enable-prefix-caching"),
        (["--sglang-page-size", "32"], "vllm_block_size", 32, "--vllm-block-size"),
        (["--sglang-kv-cache-dtype", "fp8_e4m3"], "vllm_kv_cache_dtype", "fp8_e4m3", "--vllm-kv-cache-dtype"),
        (["--sglang-router-request-timeout-secs", "600"], "router_request_timeout_secs", 600, "--router-request-timeout-secs"),
        (["--sglang-ep-size", "4", "--rollout-num-gpus-per-engine", "4", "--rollout-num-gpus", "4"],
         "vllm_enable_expert_parallel", True, "--vllm-enable-expert-parallel"),
        (["--sglang-mem-fraction-static=0.5"], "vllm_gpu_memory_utilization", 0.5, "--vllm-gpu-memory-utilization"),
        (["--sglang-reasoning-parser", "qwen3"], "vllm_reasoning_parser", "qwen3", "--vllm-reasoning-parser"),
        (["--sglang-tool-call-parser", "qwen3_coder"], "vllm_tool_call_parser", "qwen3_coder", "--vllm-tool-call-parser"),
        (["--sglang-tool-call-parser", "qwen25"], "vllm_tool_call_parser", "hermes", "--vllm-tool-call-parser"),
    ],
)  # fmt: skip
def test_mapped_sglang_flags_set_the_flag_they_mean(caplog, flags, dest, value, vllm_flag):
    args, lines = _parse_logged(caplog, *flags)
    assert getattr(args, dest) == value
    assert len(lines) == 1 and f"-> {vllm_flag}" in lines[0] and flags[0].split("=")[0] in lines[0]
    if vllm_flag.startswith("--vllm-"):  # the engine gets it as if the user had typed the vLLM flag
        assert vllm_flag.removeprefix("--vllm") in " ".join(map(str, passthrough_cli_args(args, "vllm")))


def test_router_address_and_concurrency_reach_slimes_names_too(caplog):
    args, lines = _parse_logged(
        caplog,
        "--sglang-router-ip",
        "10.0.0.2",
        "--sglang-router-port",
        "3000",
        "--sglang-server-concurrency",
        "8",
    )
    assert (args.vllm_router_ip, args.vllm_router_port) == ("10.0.0.2", 3000)
    assert (args.sglang_router_ip, args.sglang_router_port, args.sglang_server_concurrency) == (
        "10.0.0.2",
        3000,
        8,
    )
    assert len(lines) == 3


def test_flags_vllm_always_has_map_to_nothing_with_a_line(caplog):
    args, lines = _parse_logged(caplog, "--sglang-enable-metrics", "--sglang-ep-size", "1")
    assert len(lines) == 2 and "always serve Prometheus /metrics" in lines[0] and "nothing to set" in lines[1]
    assert not args.vllm_enable_expert_parallel


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--sglang-dp-size", "8"], "--vllm-data-parallel-size"),
        (["--sglang-enable-dp-attention"], "--rollout-num-gpus-per-engine"),
        (["--sglang-speculative-algorithm", "EAGLE"], "--vllm-speculative-config"),
        (["--sglang-deepep-mode", "auto"], "--vllm-all2all-backend"),
        (["--sglang-attention-backend", "fa3"], "--vllm-attention-backend"),
        (["--sglang-config", "x.yaml"], "--vllm-config"),
        (["--sglang-foo-bar", "1"], "--vllm-<flag> (list them with --help-vllm)"),
        (
            ["--sglang-tool-call-parser", "nope"],
            "vLLM has no tool parser 'nope'; pass vLLM's as --vllm-tool-call-parser",
        ),
        (["--sglang-ep-size", "8"], "--rollout-num-gpus-per-engine 1"),
        (["--sglang-mem-fraction-static"], "takes one value"),
        (["--sglang-chunked-prefill-size", "big"], "--sglang-chunked-prefill-size big: invalid literal"),
    ],
)
def test_other_sglang_flags_are_refused_with_what_to_pass(capsys, flags, says):
    with pytest.raises(SystemExit):
        parse_args([*BASE, *flags])
    err = capsys.readouterr().err
    assert flags[0] in err and says in err


def test_translation_keeps_other_tokens_and_every_table_entry_is_an_sglang_flag():
    argv = ["--rollout-seed", "-3", "--sglang-cuda-graph-bs", "1", "2", "--colocate"]
    assert translate_sglang_flags(argv) == [
        "--rollout-seed", "-3", "--vllm-cudagraph-capture-sizes", "1", "2", "--colocate",
    ]  # fmt: skip
    assert all(flag.startswith("--sglang-") for flag in [*MAPPED, *REFUSED]) and not set(MAPPED) & set(
        REFUSED
    )
