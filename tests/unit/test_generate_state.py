"""GenerateState: slime's per-rollout state for custom generate functions (tokenizer, sampling params, bounds)."""

from __future__ import annotations

import asyncio

from vime.rollout.generate_state import GenerateState
from vime.rollout.vllm_rollout import close_contexts, get_context
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils.arguments import parse_args
from vime.utils.run_context import PluginArgs, RunContext


def test_generate_state_is_shared_and_exposes_what_plug_ins_use(tmp_path):
    model = build_tiny_model(tmp_path / "m", seed=0, task=None)
    args = parse_args(
        ["--train-backend", "fsdp", "--hf-checkpoint", str(model), "--prompt-data", "p.jsonl",
         "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--num-rollout", "1",
         "--rollout-max-response-len", "7", "--rollout-concurrency", "3"]
    )  # fmt: skip
    # what a generate function is handed: the flags, and the run's router and engines behind them
    args = PluginArgs(args, RunContext(router_ip="127.0.0.1", router_port=1, engine_urls=["a", "b"]))

    async def main():
        state = GenerateState(args)
        assert GenerateState(args) is state and state.router_url == "http://127.0.0.1:1"
        assert state.tokenizer("ab", add_special_tokens=False)["input_ids"] == [14, 15]
        params = state.sampling_params
        assert params["max_tokens"] == 7 and params["temperature"] == 1.0
        params["max_tokens"] = 1  # a copy: the next caller gets the flags' values again
        assert state.sampling_params["max_tokens"] == 7
        assert state.semaphore._value == 6  # --rollout-concurrency x engines, as the rollout's own bound
        assert not state.aborted
        get_context(args).aborting = True
        assert state.aborted
        await close_contexts()

    asyncio.run(main())
