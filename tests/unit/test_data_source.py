"""The data buffer: grouping, epochs, the partial-rollout buffer, and exact resume from a save."""

from __future__ import annotations

import argparse
import json
import pickle

import pytest

from vime.rollout.data_source import RolloutDataSource, pop_oldest
from vime.utils.data import PromptDataset
from vime.utils.types import Sample, Status

NUM_PROMPTS = 10


def make_args(**overrides) -> argparse.Namespace:
    values = dict(
        prompt_data="prompts.jsonl",
        rollout_seed=7,
        rollout_shuffle=True,
        rollout_batch_size=4,
        n_samples_per_prompt=3,
    )
    return argparse.Namespace(**{**values, **overrides})


def make_dataset(num_prompts: int = NUM_PROMPTS) -> PromptDataset:
    # Row indices start at 100 so that prompt_index (the row) differs from the position in the dataset.
    return PromptDataset(
        samples=[
            Sample(index=100 + i, prompt=f"p{i}", tokens=[i, i + 1], label=str(i), metadata={"n": i})
            for i in range(num_prompts)
        ]
    )


def make_source(**overrides) -> RolloutDataSource:
    return RolloutDataSource(make_args(**overrides), tokenizer=None, dataset=make_dataset())


def prompt_indices(groups: list[list[Sample]]) -> list[int]:
    assert all(len({s.metadata["prompt_index"] for s in group}) == 1 for group in groups)
    return [group[0].metadata["prompt_index"] for group in groups]


def as_dicts(groups: list[list[Sample]]) -> list[list[dict]]:
    return [[sample.to_dict() for sample in group] for group in groups]


def partial_group(source: RolloutDataSource) -> list[Sample]:
    """A group as partial rollout hands it back: aborted, with some response tokens and log-probs."""
    group = source.get_samples(1)[0]
    for sample in group:
        sample.tokens += [7, 8]
        sample.response_length = 2
        sample.rollout_log_probs = [-0.25, -1.5]
        sample.loss_mask = [1, 1]
        sample.status = Status.ABORTED
    return group


def test_groups_are_independent_copies_with_running_indices():
    source = make_source(rollout_shuffle=False)
    groups = source.get_samples(2)
    assert [[(s.group_index, s.index) for s in g] for g in groups] == [
        [(0, 0), (0, 1), (0, 2)],
        [(1, 3), (1, 4), (1, 5)],
    ]
    assert prompt_indices(groups) == [100, 101]
    first = groups[0][0]
    assert (first.prompt, first.tokens, first.label, first.status) == ("p0", [0, 1], "0", Status.PENDING)
    assert first.metadata == {"n": 0, "prompt_index": 100}
    first.tokens.append(99)
    first.metadata["n"] = -1
    assert groups[0][1].tokens == [0, 1] and groups[0][1].metadata["n"] == 0
    assert source.dataset.samples[0].tokens == [0, 1] and source.dataset.samples[0].metadata == {"n": 0}
    assert source.get_samples(1)[0][0].group_index == 2


def test_without_shuffle_prompts_come_in_file_order_across_epochs():
    source = make_source(rollout_shuffle=False)
    served = prompt_indices(source.get_samples(13))
    assert served == [100 + i for i in range(10)] + [100, 101, 102]
    assert (source.epoch_id, source.offset) == (1, 3)


def test_two_shuffled_epochs_serve_every_prompt_exactly_once_per_epoch():
    source = make_source()
    served = []
    for size in (3, 3, 3, 3, 3, 3, 2):
        served += prompt_indices(source.get_samples(size))
    everything = [100 + i for i in range(NUM_PROMPTS)]
    first, second = served[:NUM_PROMPTS], served[NUM_PROMPTS:]
    assert sorted(first) == everything and sorted(second) == everything
    assert first != everything and first != second  # shuffled, and reshuffled each epoch
    assert (source.epoch_id, source.offset) == (2, 0)


def test_epoch_id_counts_completed_passes():
    source = make_source()
    source.get_samples(9)
    assert source.epoch_id == 0
    source.get_samples(1)
    assert source.epoch_id == 1
    source.get_samples(25)
    assert source.epoch_id == 3


def test_num_rollout_per_epoch_rounds_down():
    assert make_source(rollout_batch_size=4).num_rollout_per_epoch == 2
    assert make_source(rollout_batch_size=5).num_rollout_per_epoch == 2
    assert make_source(rollout_batch_size=11).num_rollout_per_epoch == 0


def test_buffered_groups_come_first_fifo_and_unchanged():
    source = make_source()
    first, second = partial_group(source), partial_group(source)
    expected = as_dicts([first, second])
    source.add_samples([first])
    source.add_samples([second])
    assert source.buffer_size == 2
    out = source.get_samples(1)
    assert as_dicts(out) == expected[:1] and source.buffer_size == 1
    out = source.get_samples(3)
    assert as_dicts(out[:1]) == expected[1:] and source.buffer_size == 0
    # The two fresh groups continue the counters and the prompt order where they stopped.
    assert [g[0].group_index for g in out[1:]] == [2, 3]
    reference = make_source()
    assert prompt_indices(out[1:]) == prompt_indices(reference.get_samples(4)[2:])


def test_add_samples_rejects_empty_or_foreign_groups():
    source = make_source()
    with pytest.raises(ValueError, match="group 1 must be a non-empty list of Sample"):
        source.add_samples([source.get_samples(1)[0], []])
    with pytest.raises(ValueError, match=r"group 0 .*got 1 items of types \[.dict.\]"):
        source.add_samples([[{"tokens": [1]}]])
    assert source.buffer_size == 0


def test_get_samples_rejects_negative_count():
    with pytest.raises(ValueError, match="num_groups must be >= 0"):
        make_source().get_samples(-1)


@pytest.mark.parametrize("served_before", [0, 1, 2, 3, 5])  # batches of 4 over 10 prompts: crosses epochs
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("with_buffer", [True, False])
def test_resume_from_save_serves_exactly_what_the_original_would(
    tmp_path, served_before, shuffle, with_buffer
):
    original = make_source(rollout_shuffle=shuffle)
    for _ in range(served_before):
        original.get_samples(4)
    if with_buffer:
        original.add_samples([partial_group(original), partial_group(original)])
    path = original.save(served_before, tmp_path)
    assert path == tmp_path / f"iter_{served_before:07d}" / "data_source.json"

    resumed = make_source(rollout_shuffle=shuffle)
    resumed.load(served_before, tmp_path)
    assert resumed.buffer_size == original.buffer_size == (2 if with_buffer else 0)
    assert resumed.state_dict() == original.state_dict()
    for _ in range(4):  # 16 more prompts: at least one more epoch boundary
        expected, got = original.get_samples(4), resumed.get_samples(4)
        assert as_dicts(got) == as_dicts(expected)
    assert resumed.epoch_id == original.epoch_id


def test_state_dict_round_trips_through_json():
    source = make_source()
    source.get_samples(6)
    source.add_samples([partial_group(source)])
    state = json.loads(json.dumps(source.state_dict()))
    assert state["dataset"] == {
        "num_prompts": NUM_PROMPTS,
        "spec": "prompts.jsonl",
        "rollout_seed": 7,
        "rollout_shuffle": True,
    }
    assert (state["epoch_id"], state["offset"], state["next_group_index"], state["next_sample_index"]) == (
        0,
        7,
        7,
        21,
    )
    assert state["buffer"][0][0]["rollout_log_probs"] == [-0.25, -1.5]
    other = make_source()
    other.load_state_dict(state)
    assert as_dicts(other.buffer) == as_dicts(source.buffer)
    assert as_dicts(other.get_samples(3)) == as_dicts(source.get_samples(3))


@pytest.mark.parametrize(
    ("overrides", "dataset_size", "message"),
    [
        ({}, 12, r"'prompts.jsonl' \(10 prompts\) but this run has 'prompts.jsonl' \(12 prompts\)"),
        ({"prompt_data": "other.jsonl"}, 10, r"spec: saved 'prompts.jsonl' vs now 'other.jsonl'"),
        ({"rollout_seed": 8}, 10, r"rollout_seed: saved 7 vs now 8"),
        ({"rollout_shuffle": False}, 10, r"rollout_shuffle: saved True vs now False"),
    ],
)
def test_loading_state_of_another_dataset_names_both(tmp_path, overrides, dataset_size, message):
    make_source().save(3, tmp_path)
    other = RolloutDataSource(make_args(**overrides), tokenizer=None, dataset=make_dataset(dataset_size))
    with pytest.raises(ValueError, match=message) as info:
        other.load(3, tmp_path)
    assert str(tmp_path / "iter_0000003" / "data_source.json") in str(info.value)


def test_load_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"iter_0000005[/\\]data_source.json"):
        make_source().load(5, tmp_path)


def test_load_rejects_malformed_state(tmp_path):
    source = make_source()
    path = source.save(1, tmp_path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="data_source.json"):
        source.load(1, tmp_path)
    state = source.state_dict()
    del state["offset"]
    with pytest.raises(ValueError, match=r"lacks \['offset'\]"):
        source.load_state_dict(state)
    with pytest.raises(ValueError, match="version 99"):
        source.load_state_dict({**source.state_dict(), "version": 99})


def test_save_is_atomic_and_replaces(tmp_path):
    source = make_source()
    source.get_samples(2)
    path = source.save(4, tmp_path)
    before = path.read_text()
    source.add_samples([[Sample(metadata={"unserialisable": object()})]])
    with pytest.raises(TypeError):
        source.save(4, tmp_path)
    assert path.read_text() == before  # the failed write left the previous file intact
    assert [p.name for p in path.parent.iterdir()] == ["data_source.json"]  # and no temp file
    source.buffer.clear()
    source.get_samples(1)
    source.save(4, tmp_path)
    assert json.loads(path.read_text())["offset"] == 3


def test_loads_prompt_data_from_args(tmp_path):
    from vime.tools.make_tiny_model import build_tokenizer

    rows = [{"prompt": f"{n}+3=", "label": str(n + 3), "metadata": {"n": n}} for n in range(5)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = make_args(
        prompt_data=f"{data}@[1:]",
        input_key="prompt",
        label_key="label",
        metadata_key="metadata",
        tool_key=None,
        apply_chat_template=False,
        apply_chat_template_kwargs={},
        rollout_max_prompt_len=None,
        rollout_shuffle=False,
    )
    source = RolloutDataSource(args, build_tokenizer())
    assert len(source.dataset) == 4
    group = source.get_samples(1)[0]
    assert (group[0].prompt, group[0].label, group[0].metadata) == ("1+3=", "4", {"n": 1, "prompt_index": 1})


def test_pickles_for_ray():
    source = make_source()
    source.get_samples(3)
    source.add_samples([partial_group(source)])
    copy = pickle.loads(pickle.dumps(source))
    assert as_dicts(copy.get_samples(5)) == as_dicts(source.get_samples(5))


def _versioned(index: int, *versions: list) -> list[Sample]:
    """A group of one sample per ``versions`` entry, each recording those weight versions."""
    return [Sample(index=index * 10 + i, weight_versions=list(v)) for i, v in enumerate(versions)]


def test_buffer_sort_by_staleness_takes_the_oldest_version_first_and_keeps_ties_in_order():
    # oldest versions: 7, none, 3 (slime's string versions count as numbers), 3, none ("default" is no number)
    groups = [
        _versioned(0, [7], [9]),
        _versioned(1, [], []),
        _versioned(2, ["8"], ["3", "8"]),
        _versioned(3, [3], []),
        _versioned(4, ["default"], []),
    ]
    buffer = list(groups)
    assert pop_oldest(None, None, buffer, 2) == [groups[2], groups[3]]
    assert buffer == [groups[0], groups[1], groups[4]]  # the rest stays sorted: versioned, then unversioned
    assert pop_oldest(None, None, buffer, 5) == [groups[0], groups[1], groups[4]] and buffer == []


@pytest.mark.parametrize("sort_by_staleness", [False, True])
def test_buffer_sort_is_opt_in_and_a_buffer_filter_wins(sort_by_staleness):
    fresh, stale = _versioned(0, [5]), _versioned(1, [2])
    source = make_source(buffer_sort_by_staleness=sort_by_staleness)
    source.add_samples([fresh, stale])
    first, second = (stale, fresh) if sort_by_staleness else (fresh, stale)
    assert source.get_samples(1) == [first] and source.get_samples(1) == [second]
    source = make_source(
        buffer_sort_by_staleness=True, buffer_filter_path="tests.unit.test_data_source.take_last"
    )
    source.add_samples([stale, fresh])
    assert source.get_samples(1) == [fresh]  # the filter's pick, not the stalest


def take_last(args, rollout_id, buffer, num_groups):
    """A --buffer-filter-path for the test above: the most recently added groups first."""
    taken = buffer[-num_groups:]
    del buffer[-num_groups:]
    return taken[::-1]
