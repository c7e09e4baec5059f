"""In-flight weight updates (``--flush-cache-interval 3``) on the pooled engines: the fully-async rollout keeps
groups generating while weight syncs land (the real sync protocol, disk transport), an in-place sync leaves the
sequences in flight running, and they finish on the new weights with each token's version recorded; a full-refresh
sync aborts them instead and their groups are generated again.

The timing is made certain, not waited for. Requests never sample a stop token under the checkpoint's weights (a logit
bias of -100 on EOS and on ``<|endoftext|>``, which the tiny model's generation config stops on too), so they run until
a sync lands or ``MAX_TOKENS``. The test lets them run only for bounded times: a quarter of a second once the groups are
in flight, then it freezes them (``/pause?mode=keep``) while a request still on its way to the other engine arrives (it
waits there), then thaws them and calls the in-place sync at once, so they run on only while the sync stages its
weights (files written, ``before_weight_update`` hooks) before its own pause (``keep``) freezes them again. (Waiting
for the engines' token counter instead, with or without a freeze after it, let a group reach ``MAX_TOKENS`` under the
checkpoint's weights in two CI runs, ``[[1, 0, 1500]]`` twice: under load that counter said little about what the
sequences had generated.) Before the full refresh the test freezes them as soon as the in-place sync before it
returns: the refresh's pause aborts them all the same, and no sequence of the in-place version can finish first.

The "bigram" weights make the KV cache irrelevant: with every ``o_proj`` and ``down_proj`` zero each layer adds
nothing to the residual stream, and the next token depends on the previous one alone,
``log_softmax(lm_head(rms_norm(embed[prev])) + bias)``; their EOS row is set so that EOS stays likely despite the
bias, so sequences end soon after a sync to them. Tokens the engines label with the bigram version
must carry exactly the bigram log-probs (they were sampled by those weights, from the first token of the span on), the
tokens before them not.
"""

from __future__ import annotations

import threading
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
from vime.utils.types import Sample, Status

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

INTERVAL = 3  # syncs 1 and 4 are full refreshes, 2 and 3 in place
MAX_TOKENS = 1500  # never reached: the sequences run unfrozen only while a sync stages its weights
EOS = 2  # the tiny model's <|im_end|>
END_OF_TEXT = 0  # its <|endoftext|>: its generation config stops on it too (~1.5% a token before a sync)
BIAS = -100.0  # on both, in every request
EOS_LOGIT = 3.0  # EOS's logit under the bigram weights, bias included: a few percent per token


def _args(model_dir: Path, tmp_path: Path, pool: EnginePool):
    return parse_args(
        [
            "--train-backend", "fsdp", "--debug-rollout-only", "--hf-checkpoint", str(model_dir),
            "--prompt-data", str(model_dir / "train.jsonl"), "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", str(MAX_TOKENS), "--rm-type", "exact",
            "--num-rollout", "1", "--rollout-external-engine-addrs", *pool.addrs(), "--log-dir", str(tmp_path),
            "--flush-cache-interval", str(INTERVAL),
        ]
    )  # fmt: skip


def _bigram(
    weights: dict[str, torch.Tensor], eps: float = 1e-6
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The bigram weights and their ``[previous token, next token]`` log-probs (with the stop tokens' bias)."""
    bigram = {
        name: torch.zeros_like(t) if name.endswith(("o_proj.weight", "down_proj.weight")) else t.clone()
        for name, t in weights.items()
    }
    h = bigram["model.embed_tokens.weight"]
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * bigram["model.norm.weight"]
    target = torch.full((h.shape[0], 1), EOS_LOGIT - BIAS)  # EOS's logit after every token, before the bias
    bigram["lm_head.weight"][EOS] = torch.linalg.lstsq(h, target).solution[:, 0]
    logits = h @ bigram["lm_head.weight"].T
    logits[:, [EOS, END_OF_TEXT]] += BIAS
    return bigram, torch.log_softmax(logits, dim=-1)


def _freeze(urls: list[str]) -> None:
    """Freeze the requests in flight on every engine (``/pause?mode=keep``) until :func:`_thaw` or the next sync
    resumes (or aborts) them: a sync stages its weights (files written, ``before_weight_update`` hooks) before its
    own pause."""
    with EngineGroup(urls) as engines:
        engines.run(lambda engine: engine.pause(mode="keep"))


def _thaw(urls: list[str]) -> None:
    """Let frozen requests (and those that arrived meanwhile) run on."""
    with EngineGroup(urls) as engines:
        engines.run(lambda engine: engine.resume())


def _span_errors(sample: Sample, table: torch.Tensor, start: int, end: int) -> list[float]:
    """|rollout log-prob - bigram log-prob| of response tokens ``start:end``."""
    prompt, tokens = sample.prompt_length, sample.tokens
    return [
        abs(sample.rollout_log_probs[i] - table[tokens[prompt + i - 1], tokens[prompt + i]].item())
        for i in range(start, end)
    ]


def test_a_sync_in_place_finishes_sequences_on_the_new_weights_and_a_refresh_aborts_them(
    tiny_model_dir, tmp_path, engine_pool
):
    args = _args(tiny_model_dir, tmp_path, engine_pool)
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    bigram, table = _bigram(base)
    manager = RolloutManager(args, tmp_path)
    manager.start()
    rollout = FullyAsyncRollout(args, manager.data_source)
    manager.functions.rollout = rollout  # the manager calls its hooks around each sync, as in a run
    rollout.worker = worker = FullyAsyncWorker(args, manager.data_source, manager.run_context)
    worker.params["logit_bias"] = {str(EOS): BIAS, str(END_OF_TEXT): BIAS}
    worker.max_in_flight = 2  # one rollout's groups at a time

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

    def in_flight() -> float:
        """Until the worker has groups in flight; the deadline for what follows."""
        deadline = time.monotonic() + 120
        while not worker.in_flight:
            assert time.monotonic() < deadline, "no group in flight"
            time.sleep(0.01)
        return deadline

    def generating_then_frozen() -> None:
        """Groups in flight generate for a quarter of a second (at 0.5 s, staging included, up to ~220 tokens were seen
        here; a sequence needs ``MAX_TOKENS`` to finish), then they are frozen for a second in which a request still
        on its way to the other engine arrives and waits there. A fixed time, not the engines' token counter: waiting
        for it, a group reached ``MAX_TOKENS`` in two CI runs."""
        in_flight()
        time.sleep(0.25)
        _freeze(manager.engine_urls())
        time.sleep(1.0)

    try:
        assert sync(1, base)["weight_sync/full_refresh"] == 1.0
        batches = []
        collect = threading.Thread(target=lambda: batches.append(manager.generate(0, weights_ahead=True)))
        collect.start()
        generating_then_frozen()
        # they run while the sync stages its weights, then its own pause keeps them in flight
        _thaw(manager.engine_urls())
        assert sync(2, bigram)["weight_sync/full_refresh"] == 0.0
        collect.join(timeout=300)
        samples = [s for g in batches[0].samples for s in g]
        crossed = [
            s for s in samples if s.weight_versions == [1, 2]
        ]  # began under version 1, finished under 2
        assert len(samples) == 4 and len(crossed) >= 2, [s.weight_version_spans for s in samples]
        assert all(
            s.weight_versions == [2] for s in samples if s not in crossed
        ), [  # else began after the sync
            s.weight_version_spans for s in samples
        ]
        for sample in crossed:
            (old, zero, boundary), (new, start, end) = sample.weight_version_spans
            assert (old, zero, new, start, end) == (1, 0, 2, boundary, sample.response_length), (
                sample.weight_version_spans
            )
            assert sample.weight_versions == [1, 2] and 0 < boundary < end < MAX_TOKENS
            assert sample.status == Status.COMPLETED and sample.tokens[-1] == EOS
            # sampled by version 2 from the span's first token on, by version 1 before it
            assert max(_span_errors(sample, table, boundary, end)) < 1e-3
            before = _span_errors(sample, table, 0, boundary)
            assert sum(before) / len(before) > 0.05, before

        # in place: the groups in flight would go on generating (no stop token now), so they are frozen at once (left
        # to run, two once reached MAX_TOKENS first); a group sent after the freeze waits on its engine
        sync(3, base)
        _freeze(manager.engine_urls())
        in_flight()
        assert sync(4, bigram)["weight_sync/full_refresh"] == 1.0  # this refresh aborts them
        refreshed = manager.generate(1)
        assert refreshed.metrics["fully_async/aborted_groups"] >= 1
        # each finished under version 2 before sync 3, or was generated again, from its prompt, after sync 4
        assert all(s.weight_versions in ([2], [4]) for g in refreshed.samples for s in g), [
            s.weight_version_spans for g in refreshed.samples for s in g
        ]
    finally:
        rollout.stop()
        manager.shutdown()
