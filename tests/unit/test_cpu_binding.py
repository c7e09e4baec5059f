"""CPU engines on one machine split its cores: the ``VLLM_CPU_OMP_THREADS_BIND`` each engine is started with."""

from __future__ import annotations

import argparse

from vime.backends.vllm_utils.cpu_binding import BIND_ENV, cpu_bind_env
from vime.backends.vllm_utils.engine import VLLMEngine

CPUS = list(range(8))


def test_engines_take_contiguous_disjoint_slices_of_the_cpus():
    binds = [cpu_bind_env((i, 3), cpus=CPUS, environ={})[BIND_ENV] for i in range(3)]
    assert binds == ["0,1", "2,3,4", "5,6,7"]


def test_tensor_parallel_ranks_split_their_engines_slice():
    assert cpu_bind_env((1, 2), tensor_parallel=2, cpus=CPUS, environ={}) == {BIND_ENV: "4,5|6,7"}
    assert cpu_bind_env((0, 4), tensor_parallel=3, cpus=CPUS, environ={}) == {}  # 2 cores for 3 ranks: vLLM's


def test_more_engines_than_cpus_share_them_round_robin():
    assert [cpu_bind_env((i, 3), cpus=[4, 5], environ={})[BIND_ENV] for i in range(3)] == ["4", "5", "4"]


def test_vllms_own_choice_stands_alone_or_when_the_user_set_it():
    assert cpu_bind_env(None, cpus=CPUS, environ={}) == {}
    assert cpu_bind_env((0, 1), cpus=CPUS, environ={}) == {}
    assert cpu_bind_env((0, 2), cpus=CPUS, environ={BIND_ENV: "0-3"}) == {}


def test_the_engine_server_starts_with_its_share(monkeypatch):
    monkeypatch.delenv(BIND_ENV, raising=False)
    args = argparse.Namespace(
        hf_checkpoint="/m",
        rollout_seed=1,
        rollout_num_gpus_per_engine=1,
        engine_start_timeout=60,
        use_score_centering=False,
    )
    engine = VLLMEngine(args, cpu_share=(1, 2))
    assert engine.env[BIND_ENV] == cpu_bind_env((1, 2), environ={})[BIND_ENV]
    assert BIND_ENV not in VLLMEngine(args).env  # no share: vLLM's own binding
