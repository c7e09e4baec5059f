"""The rollout's routed experts (``Sample.rollout_routed_experts``): the compact array and its JSON form, reading
an engine's completion choices (first request, continuation, abort), the data buffer's save/load, the debug
rollout files, the engine flag (refused on CPU engines) and the flag checks."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from vime.backends.vllm_utils import routed_experts as engine_routing
from vime.rollout.data_source import RolloutDataSource
from vime.rollout.rollout_manager import RolloutManager, load_rollout_data, save_rollout_data
from vime.rollout.vllm_generate import RolloutError, _apply_choice, reset_to_prompt
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils import routed_experts
from vime.utils.arguments import parse_args
from vime.utils.data import PromptDataset
from vime.utils.types import RolloutFnTrainOutput, Sample, Status


def experts(rows: int, layers: int = 3, topk: int = 2, high: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, (rows, layers, topk)).astype(np.uint8)


# ------------------------------------------------------------------------------------------------- the array
def test_compact_picks_the_narrowest_dtype_and_json_round_trips():
    assert routed_experts.compact([[[3, 255]]]).dtype == np.uint8
    assert routed_experts.compact(torch.tensor([[[3, 300]]])).dtype == np.uint16
    assert routed_experts.compact(np.array([[[70000, 1]]])).dtype == np.int32
    array = experts(5)
    text = json.dumps(routed_experts.encode(array))
    back = routed_experts.decode(json.loads(text))
    assert back.dtype == np.uint8 and np.array_equal(back, array)
    assert np.array_equal(routed_experts.decode(array.tolist()), array)  # slime writes nested lists
    assert routed_experts.decode(None) is None
    with pytest.raises(ValueError, match="not base64 of a .npy array"):
        routed_experts.decode("not*base64")
    with pytest.raises(ValueError, match=r"must be \[tokens, layers, topk\]"):
        routed_experts.compact([[1, 2]])
    with pytest.raises(ValueError, match="non-negative integers"):
        routed_experts.compact([[[-1, 2]]])


def test_sample_dict_round_trip_keeps_the_routing_and_reads_slimes_field():
    sample = Sample(index=3, tokens=[1, 2, 3, 4], response_length=2, rollout_routed_experts=experts(3))
    back = Sample.from_dict(json.loads(json.dumps(sample.to_dict())))
    assert np.array_equal(back.rollout_routed_experts, sample.rollout_routed_experts)
    assert back.rollout_routed_experts.dtype == np.uint8
    slime = {**Sample(tokens=[1, 2, 3]).to_dict(), "rollout_routed_experts": experts(2).tolist()}
    from_slime = Sample.from_dict(slime)
    assert np.array_equal(from_slime.rollout_routed_experts, experts(2))
    assert "slime" not in from_slime.metadata


# ------------------------------------------------------------------------------------ engine completion choices
def choice(tokens: list[int], routing: np.ndarray | None, finish: str = "stop") -> dict:
    return {
        "token_ids": tokens,
        "logprobs": {"token_logprobs": [-0.5] * len(tokens)},
        "text": "x" * len(tokens),
        "finish_reason": finish,
        "routed_experts": routing if routing is None else routed_experts.encode(routing),
    }


def test_a_choice_routing_covers_all_tokens_but_the_last_and_a_continuation_replaces_it():
    args = argparse.Namespace(weight_version=0, use_rollout_routing_replay=True, use_score_centering=False)
    sample = Sample(index=0, tokens=[5, 6, 7], status=Status.PENDING)  # a 3-token prompt
    full = experts(8, seed=1)
    _apply_choice(args, sample, choice([8, 9], full[:4], finish="abort"), 0)  # aborted: 5 tokens, 4 rows
    assert sample.status == Status.ABORTED and np.array_equal(sample.rollout_routed_experts, full[:4])
    # the continuation's request re-sends all 5 tokens; the engine returns routing for the whole sequence again
    _apply_choice(args, sample, choice([10, 11, 12, 13], full), 0)
    assert sample.tokens == [5, 6, 7, 8, 9, 10, 11, 12, 13] and np.array_equal(
        sample.rollout_routed_experts, full
    )
    # an abort before any forward returns none: the earlier routing stays (it covers a prefix)
    partial = Sample(index=1, tokens=[5, 6, 7], rollout_routed_experts=full[:2], status=Status.PENDING)
    _apply_choice(args, partial, choice([], None, finish="abort"), 0)
    assert np.array_equal(partial.rollout_routed_experts, full[:2])
    reset_to_prompt(sample)
    assert sample.rollout_routed_experts is None and sample.tokens == [5, 6, 7]


def test_a_choice_without_routing_or_with_the_wrong_rows_fails():
    args = argparse.Namespace(weight_version=0, use_rollout_routing_replay=True, use_score_centering=False)
    with pytest.raises(RolloutError, match="returned no routed_experts for a finished request"):
        _apply_choice(args, Sample(index=0, tokens=[5, 6]), choice([8], None), 0)
    with pytest.raises(ValueError, match="routed experts for 4 tokens, expected 2"):
        _apply_choice(args, Sample(index=0, tokens=[5, 6]), choice([8], experts(4)), 0)
    with pytest.raises(ValueError, match="routed experts for 1 tokens, expected 2"):
        _apply_choice(args, Sample(index=0, tokens=[5, 6]), choice([8], experts(1)), 0)
    aborted = _apply_choice(args, Sample(index=0, tokens=[5, 6]), choice([8], experts(1), finish="abort"), 0)
    assert len(aborted.rollout_routed_experts) == 1  # a prefix; the continuation returns them all
    plain = argparse.Namespace(weight_version=0, use_rollout_routing_replay=False, use_score_centering=False)
    assert (
        _apply_choice(plain, Sample(index=0, tokens=[5, 6]), choice([8], None), 0).rollout_routed_experts
        is None
    )


# ------------------------------------------------------------------------------------ buffer and debug files
def test_data_buffer_save_and_load_keep_a_partial_samples_routing(tmp_path):
    args = argparse.Namespace(
        prompt_data="p.jsonl",
        rollout_seed=1,
        rollout_shuffle=False,
        rollout_batch_size=1,
        n_samples_per_prompt=2,
    )
    dataset = PromptDataset(samples=[Sample(index=i, prompt=f"p{i}", tokens=[i, i + 1]) for i in range(3)])
    source = RolloutDataSource(args, None, dataset)
    group = source.get_samples(1)[0]
    for seed, sample in enumerate(group):
        sample.tokens += [7, 8]
        sample.response_length, sample.status = 2, Status.ABORTED
        sample.rollout_routed_experts = experts(3, seed=seed)
    source.add_samples([group])
    source.save(4, tmp_path)
    resumed = RolloutDataSource(args, None, dataset)
    resumed.load(4, tmp_path)
    for before, after in zip(group, resumed.get_samples(1)[0], strict=True):
        assert after == before and np.array_equal(after.rollout_routed_experts, before.rollout_routed_experts)


def test_debug_rollout_data_round_trips_the_routing(tmp_path):
    groups = [[Sample(index=i, tokens=[1, 2, 3], response_length=1, rollout_routed_experts=experts(2, seed=i))
               for i in range(2)]]  # fmt: skip
    save_rollout_data(tmp_path / "rollout_0.json", 0, RolloutFnTrainOutput(samples=groups))
    loaded = load_rollout_data(tmp_path / "rollout_0.json").samples
    for before, after in zip(groups[0], loaded[0], strict=True):
        assert np.array_equal(after.rollout_routed_experts, before.rollout_routed_experts)


# ------------------------------------------------------------------------------------------------ engines
def test_engines_return_routed_experts_only_on_gpu():
    import vllm

    with pytest.raises(ValueError, match="needs GPU vLLM engines.*Model Runner V2 requires Triton"):
        engine_routing.engine_options(on_gpu=False)
    flags, env = engine_routing.engine_options(on_gpu=True)
    assert flags == ["--enable-return-routed-experts"]
    assert env == ({"VLLM_USE_V2_MODEL_RUNNER": "1"} if vllm.__version_tuple__[:2] >= (0, 30) else {})


def test_the_rollout_manager_refuses_r3_on_cpu_engines_before_starting_any(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    model_dir = build_tiny_model(tmp_path / "model", seed=0, num_train=8, num_experts=4)
    args = parse_args(
        [
            "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--prompt-data",
            str(model_dir / "train.jsonl"), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--num-rollout", "1", "--use-rollout-routing-replay",
        ]
    )  # fmt: skip
    manager = RolloutManager(args, tmp_path / "logs")
    with pytest.raises(ValueError, match="--use-rollout-routing-replay needs GPU vLLM engines"):
        manager.start()
    assert manager.engines == [] and not list((tmp_path / "logs").glob("engine_*.log"))


# -------------------------------------------------------------------------------------------------- flags
def base_flags(*extra: str) -> list[str]:
    return ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--num-rollout", "1", *extra]  # fmt: skip


def test_flags_keep_slimes_names_and_refuse_what_cannot_work(capsys):
    args = parse_args(base_flags("--train-backend", "fsdp", "--use-rollout-routing-replay"))
    assert (
        args.use_routing_replay and args.use_rollout_routing_replay
    )  # R3 implies routing replay, as in slime
    assert not parse_args(base_flags("--train-backend", "fsdp")).use_routing_replay
    refused = [
        (
            ["--train-backend", "fsdp", "--use-routing-replay", "--use-rollout-logprobs"],
            "which --use-rollout-logprobs",
        ),
        (
            ["--train-backend", "fsdp", "--use-rollout-routing-replay", "--loss-type", "sft_loss"],
            "SFT has no",
        ),
        (["--train-backend", "megatron", "--use-routing-replay"], "--num-experts is not set"),
        (["--train-backend", "fsdp", "--use-routing-replay", "--keep-old-actor"], "routers are not hooked"),
    ]
    for extra, message in refused:
        with pytest.raises(SystemExit):
            parse_args(base_flags(*extra))
        assert message in capsys.readouterr().err
    parse_args(
        base_flags("--train-backend", "fsdp", "--use-rollout-routing-replay", "--use-rollout-logprobs")
    )
