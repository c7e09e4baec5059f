"""Core types: Sample round trip, status mapping, reward access."""

from __future__ import annotations

import json

import pytest

from vime.utils.types import Sample, Status


def test_sample_round_trips_through_json():
    sample = Sample(
        group_index=3,
        index=7,
        prompt=[{"role": "user", "content": "1+3="}],
        tokens=[1, 2, 3, 4, 5],
        response="4",
        response_length=2,
        label="4",
        reward={"acc": 1.0, "len": 0.5},
        loss_mask=[1, 0],
        rollout_log_probs=[-0.5, -1.25],
        status=Status.TRUNCATED,
        metadata={"n": 1},
        weight_versions=[2, 3],
        rollout_id=9,
        train_metadata={"k": [1]},
    )
    data = json.loads(json.dumps(sample.to_dict()))
    assert data["status"] == "truncated"
    restored = Sample.from_dict(data)
    assert restored == sample and restored.status is Status.TRUNCATED
    assert restored.prompt_length == 3


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match=r"unknown Sample fields \['rewrd'\]"):
        Sample.from_dict({"rewrd": 1.0})


@pytest.mark.parametrize(
    ("reason", "status"),
    [("stop", Status.COMPLETED), ("length", Status.TRUNCATED), ("abort", Status.ABORTED)],
)
def test_finish_reason_mapping(reason, status):
    assert Status.from_finish_reason(reason) is status


def test_unknown_finish_reason_raises():
    with pytest.raises(ValueError, match="unknown finish_reason 'error'"):
        Status.from_finish_reason("error")


def test_reward_value_scalar_and_dict():
    assert Sample(reward=0.5).reward_value() == 0.5
    assert Sample(reward={"acc": 1, "f": 0.2}).reward_value("f") == 0.2
    with pytest.raises(ValueError, match="pass --reward-key"):
        Sample(index=1, reward={"acc": 1}).reward_value()
    with pytest.raises(KeyError, match="--reward-key 'x' not in reward keys"):
        Sample(reward={"acc": 1}).reward_value("x")
    with pytest.raises(ValueError, match="has no reward yet"):
        Sample().reward_value()


def test_mark_failed_keeps_reason():
    sample = Sample()
    sample.mark_failed("reward function raised KeyError: 'x'")
    assert sample.status is Status.FAILED and sample.failure_reason == "reward function raised KeyError: 'x'"


def test_slime_plugin_surface():
    from types import SimpleNamespace

    sample = Sample(index=3, tokens=[1, 2], reward={"score": -1.0, "acc": False})
    assert Sample.Status.COMPLETED is Status.COMPLETED
    assert sample.get_reward_value(SimpleNamespace(reward_key="score")) == -1.0
    sample.append_response_tokens(tokens=[7, 8], log_probs=[-0.5, -0.25], text="ab")
    sample.append_response_tokens(tokens=[9], trainable=False, text="<tool>")
    sample.append_response_tokens(
        tokens=[4], log_probs=[-1.0], meta_info={"finish_reason": {"type": "length"}}
    )
    assert sample.tokens == [1, 2, 7, 8, 9, 4] and sample.response == "ab<tool>"
    assert sample.loss_mask == [1, 1, 0, 1] and sample.rollout_log_probs == [-0.5, -0.25, 0.0, -1.0]
    assert sample.response_length == 4 and sample.effective_response_length == 3
    assert sample.status == Status.TRUNCATED
    with pytest.raises(ValueError, match="need their rollout log-probs"):
        sample.append_response_tokens(tokens=[5])
    with pytest.raises(ValueError, match="take no log_probs"):
        sample.append_response_tokens(tokens=[5], log_probs=[0.0], trainable=False)


def test_from_dict_reads_a_slime_sample():
    slime = {"index": 1, "tokens": [1, 2, 3], "response_length": 1, "status": "completed", "rollout_id": 7,
             "session_id": "s1", "teacher_log_probs": [-0.5], "spec_info": {"spec_accept_token_num": 0}}  # fmt: skip
    sample = Sample.from_dict(slime)
    assert sample.rollout_id == 7 and sample.status == Status.COMPLETED and sample.teacher_log_probs == [-0.5]
    assert (
        sample.session_id == "s1"
        and sample.spec_info == {"spec_accept_token_num": 0}
        and sample.metadata == {}
    )
    with pytest.raises(ValueError, match="unknown Sample fields \\['typo'\\]"):
        Sample.from_dict({"typo": 1})
