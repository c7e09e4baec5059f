"""``bench/weight_sync.py``'s options: ``tensor`` (CUDA IPC, the engine on the trainer's GPU) and ``distributed`` (the
engine on the second GPU) cannot share a run, which once lost its engine at the tensor case on 2 x H100."""

from __future__ import annotations

import pytest

from bench import weight_sync as bench


def test_tensor_and_distributed_in_one_run_are_refused_with_the_fix(capsys):
    with pytest.raises(SystemExit):
        bench.parse_options(["--transports", "distributed", "tensor"])
    assert "run them in two invocations" in capsys.readouterr().err


@pytest.mark.parametrize("transports", [["tensor", "disk"], ["distributed"], ["distributed", "disk"]])
def test_one_engine_placement_per_run_is_accepted(transports):
    opts, env = bench.parse_options(["--transports", *transports, "--env", "NCCL_MIN_NCHANNELS=32"])
    assert opts.transports == transports
    assert env == {"NCCL_MIN_NCHANNELS": "32"}
