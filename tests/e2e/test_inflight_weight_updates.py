"""In-flight weight updates (``--flush-cache-interval 2``) on the pooled engines: the fully-async rollout keeps
groups generating while weight syncs land (the real sync protocol, disk transport), an in-place sync leaves the
sequences in flight running, and they finish on the new weights with each token's version recorded; a full-refresh
sync aborts them instead and their groups are generated again.

Version 2's weights make the KV cache irrelevant: with every ``o_proj`` and ``down_proj`` zero, each layer adds nothing
to the residual stream, so the next-token distribution is a function of the previous token alone,
``log_softmax(lm_head(rms_norm(embed[prev])))``. Tokens the engines label version 2 must carry exactly those
log-probs (so they were sampled by version 2, from the first token of the span on), and the tokens before them not.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import EnginePool
from safetensors.torch import load_file

from vime.backends.vllm_utils.control_client import EngineGroup
from vime.backends.vllm_utils.weight_sync import sync_weights
from vime.backends.vllm_utils.weight_transports import DiskTransport
from vime.rollout.fully_async_rollout import FullyAsyncRollout, FullyAsyncWorker
from vime.rollout.rollout_manager import RolloutManager
from vime.utils.arguments import parse_args
from vime.utils.inflight import is_full_refresh
from vime.utils.types import Sample

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

INTERVAL = 2  # sync 1 and 3 are full refreshes, sync 2 is in place
RESPONSE_TOKENS = 128  # every response (no EOS): long enough to be paused in the middle


def _args(model_dir: Path, tmp_path: Path, pool: EnginePool):
    return parse_args(
        [
            "--train-backend", "fsdp", "--debug-rollout-only", "--hf-checkpoint", str(model_dir),
            "--prompt-data", str(model_dir / "train.jsonl"), "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", str(RESPONSE_TOKENS), "--rm-type", "exact",
            "--num-rollout", "1", "--rollout-external-engine-addrs", *pool.addrs(), "--log-dir", str(tmp_path),
            "--flush-cache-interval", str(INTERVAL),
        ]
    )  # fmt: skip


def _no_residual_updates(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        name: torch.zeros_like(t) if name.endswith(("o_proj.weight", "down_proj.weight")) else t
        for name, t in weights.items()
    }


def _bigram_log_probs(weights: dict[str, torch.Tensor], eps: float) -> torch.Tensor:
    """``[previous token, next token]`` log-probs of :func:`_no_residual_updates` weights."""
    h = weights["model.embed_tokens.weight"]
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weights["model.norm.weight"]
    return torch.log_softmax(h @ weights["lm_head.weight"].T, dim=-1)


def _span_errors(sample: Sample, table: torch.Tensor, start: int, end: int) -> list[float]:
    """|rollout log-prob - bigram log-prob| of response tokens ``start:end``."""
    prompt = sample.prompt_length
    tokens = sample.tokens
    return [
        abs(sample.rollout_log_probs[i] - table[tokens[prompt + i - 1], tokens[prompt + i]].item())
        for i in range(start, end)
    ]


def test_a_sync_in_place_finishes_sequences_on_the_new_weights_and_a_refresh_aborts_them(
    tiny_model_dir, tmp_path, engine_pool
):
    args = _args(tiny_model_dir, tmp_path, engine_pool)
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    flat = _no_residual_updates(base)
    table = _bigram_log_probs(flat, eps=1e-6)
    manager = RolloutManager(args, tmp_path)
    manager.start()
    rollout = FullyAsyncRollout(args, manager.data_source)
    manager.functions.rollout = rollout  # the manager calls its hooks around each sync, as in a run
    rollout.worker = worker = FullyAsyncWorker(args, manager.data_source)
    worker.params["ignore_eos"] = True  # every response runs its full length
    # one rollout's groups at a time: those in flight when a batch returns are the next ones, just started (more groups
    # ahead would finish together with the batch)
    worker.max_in_flight = 2

    def sync(version: int, weights: dict[str, torch.Tensor]) -> dict[str, float]:
        """What a run's weight update does around the protocol (vime.ray.weight_update), on the pooled engines."""
        manager.before_weight_update()
        metrics = sync_weights(
            manager.engine_urls(),
            iter([list(weights.items())]),
            DiskTransport(tmp_path / "sync"),
            version,
            full_refresh=is_full_refresh(INTERVAL, version),
            label=True,
        )
        manager.set_weight_version(version)
        return metrics

    def hold_mid_generation(batch_s: float) -> None:
        """A third of the way through the next rollout's groups (a batch took ``batch_s``; they start as it returns),
        pause the engines in place: as the sync's own pause does, only before it writes the weights out, during which
        a fast engine could finish them. (vLLM's token counters lag, so they cannot tell how far the groups are.)"""
        deadline = time.monotonic() + 60
        while not worker.in_flight:
            assert time.monotonic() < deadline, "no group in flight"
            time.sleep(0.01)
        time.sleep(batch_s / 3)
        with EngineGroup(manager.engine_urls()) as engines:
            engines.run(lambda engine: engine.pause(mode="keep"))

    try:
        assert sync(1, base)["weight_sync/full_refresh"] == 1.0
        started = time.monotonic()
        first = manager.generate(0, train_version=1)
        batch_s = time.monotonic() - started
        assert all(s.weight_version_spans == [[1, 0, RESPONSE_TOKENS]] for g in first.samples for s in g)

        crossed: list[Sample] = []
        for rollout_id in (1, 2, 3):  # a sync that lands after every request finished is tried again
            hold_mid_generation(batch_s)
            assert sync(2, flat)["weight_sync/full_refresh"] == 0.0
            batch = manager.generate(rollout_id, train_version=2)
            crossed = [s for g in batch.samples for s in g if s.weight_versions == [1, 2]]
            if crossed:
                break
        assert crossed, "no sequence was in flight across the in-place sync"
        for sample in crossed:
            (_, zero, boundary), (_, start, end) = sample.weight_version_spans
            assert zero == 0 and start == boundary and end == sample.response_length == RESPONSE_TOKENS
            assert 0 < boundary < RESPONSE_TOKENS, sample.weight_version_spans
            # sampled by version 2 from the span's first token on, by version 1 before it
            assert max(_span_errors(sample, table, boundary, end)) < 1e-3
            before = _span_errors(sample, table, 0, boundary)
            assert sum(before) / len(before) > 0.05, before

        hold_mid_generation(batch_s)
        assert sync(3, base)["weight_sync/full_refresh"] == 1.0  # aborts the groups in flight
        refreshed = manager.generate(4, train_version=3)
        assert refreshed.metrics["fully_async/aborted_groups"] >= 1
        # each finished before sync 3, or was generated after it
        for sample in (s for g in refreshed.samples for s in g):
            versions = sample.weight_versions
            assert 3 not in versions or versions == [3], sample.weight_version_spans
    finally:
        rollout.stop()
        manager.shutdown()
