"""slime's per-sample rollout hooks: --rollout-sample-hook-path (sync and async, before the reward),
--buffer-filter-path (which buffered groups a batch takes), --mask-offpolicy-in-partial-rollout."""

from __future__ import annotations

import argparse
import asyncio

from vime.rollout import vllm_generate
from vime.rollout.data_source import RolloutDataSource
from vime.utils.data import PromptDataset
from vime.utils.run_context import PluginArgs, RunContext
from vime.utils.types import Sample, Status

CALLS: list[tuple] = []


def tag_hook(args, sample, *, rollout_id=None, evaluation=False):
    assert isinstance(args, PluginArgs)  # a plug-in: the read-only view of the flags and the run context
    CALLS.append(("sync", sample.index, rollout_id, evaluation))
    sample.metadata["tagged"] = True  # changed in place, returns None


async def replace_hook(args, sample, *, rollout_id=None, evaluation=False):
    CALLS.append(("async", sample.index, rollout_id, sample.metadata.get("tagged")))
    return Sample(index=sample.index, response="replaced", status=Status.COMPLETED, metadata=sample.metadata)


def take_last(args, rollout_id, buffer, num_groups):
    taken = buffer[-num_groups:]
    del buffer[-num_groups:]
    return taken


def test_sample_hooks_run_in_order_before_the_reward(monkeypatch):
    rewarded = []

    async def fake_reward(args, samples):
        rewarded.extend((s.index, s.response, s.metadata.get("tagged")) for s in samples)

    monkeypatch.setattr(vllm_generate, "reward_samples", fake_reward)
    CALLS.clear()
    args = argparse.Namespace(rollout_sample_hook_path=[f"{__name__}.tag_hook", f"{__name__}.replace_hook"])
    group = [Sample(index=i, status=Status.COMPLETED) for i in range(2)]
    out = asyncio.run(vllm_generate._rewarded(args, group, rollout_id=7, run_context=RunContext()))
    assert CALLS == [
        ("sync", 0, 7, False),
        ("sync", 1, 7, False),
        ("async", 0, 7, True),
        ("async", 1, 7, True),
    ]
    assert [s.response for s in out] == ["replaced", "replaced"]
    assert rewarded == [(0, "replaced", True), (1, "replaced", True)]
    CALLS.clear()  # an aborted group goes back to the buffer untouched
    aborted = [Sample(index=3, status=Status.ABORTED)]
    back = asyncio.run(vllm_generate._rewarded(args, aborted, rollout_id=8, run_context=RunContext()))
    assert back == aborted and CALLS == []


def test_buffer_filter_chooses_the_buffered_groups():
    args = argparse.Namespace(
        n_samples_per_prompt=1,
        rollout_seed=0,
        rollout_shuffle=False,
        buffer_filter_path=f"{__name__}.take_last",
    )
    source = RolloutDataSource(
        args, None, PromptDataset(samples=[Sample(index=i, prompt=str(i)) for i in range(10)])
    )
    source.add_samples([[Sample(index=100 + i)] for i in range(3)])
    assert [g[0].index for g in source.get_samples(2)] == [101, 102]
    # one buffered group left, then fresh prompts
    assert [g[0].metadata.get("prompt_index", g[0].index) for g in source.get_samples(3)] == [100, 0, 1]


def test_mask_offpolicy_in_partial_rollout_masks_the_earlier_response():
    partial = Sample(
        tokens=[1, 2, 3, 4], response_length=2, status=Status.ABORTED, rollout_log_probs=[-0.1, -0.2]
    )
    vllm_generate.mask_previous_response(partial)
    partial.append_response_tokens(tokens=[5], log_probs=[-0.3])
    assert partial.loss_mask == [0, 0, 1] and partial.rollout_log_probs == [-0.1, -0.2, -0.3]
    fresh = Sample(tokens=[1, 2], response_length=0, status=Status.PENDING)
    vllm_generate.mask_previous_response(fresh)
    assert fresh.loss_mask is None
