"""``bench/rollout_throughput.py --api-server-count N``: the served engine's command on a GPU machine (vLLM 0.25 there,
started by the bench's ``RolloutManager``) runs vLLM's ``serve`` with N API servers; the offline engine's settings are
untouched."""

from __future__ import annotations

import sys

import pytest

from bench import rollout_throughput as bench
from vime.backends.vllm_utils import engine
from vime.backends.vllm_utils.engine import build_engine_command


def _gpu_options(monkeypatch, *flags: str):
    monkeypatch.setattr(sys, "argv", ["rollout_throughput.py", "--shape", "4b", "--enforce-eager", *flags])
    monkeypatch.setattr(bench, "on_gpu", lambda: True)
    monkeypatch.setattr(engine, "cuda_available", lambda: True)
    opts = bench.parse_options()
    opts.dtype, opts.max_num_seqs, opts.max_num_batched_tokens = "bfloat16", 1024, 16384  # prepare_workload's
    return opts


@pytest.mark.parametrize(
    ("count", "module"), [(1, "vllm.entrypoints.openai.api_server"), (4, "vime.backends.vllm_utils.serve")]
)
def test_the_served_engine_runs_the_asked_api_servers_on_gpu(monkeypatch, tmp_path, count, module):
    opts = _gpu_options(monkeypatch, "--sides", "offline", "vime", "--api-server-count", str(count))
    args = bench.vime_args(opts, tmp_path, tmp_path / "logs", bench.served_flags(opts))
    command = build_engine_command(args, "127.0.0.1", 8000)
    assert command[:3] == [sys.executable, "-m", module]
    assert ("--api-server-count" in command) == (count > 1)
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.42"
    assert "api_server_count" not in bench.offline_flags(opts, args)
    name, record = bench.result(opts, args, {"offline": [2.0], "vime": [1.0]}, {})
    assert record["workload"]["api_server_count"] == count
    assert name.endswith("_4api") == (count > 1)


def test_no_api_server_is_refused(monkeypatch):
    with pytest.raises(SystemExit):
        _gpu_options(monkeypatch, "--api-server-count", "0")
