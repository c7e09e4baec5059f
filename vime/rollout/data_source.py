"""The data buffer: the prompt pool with epoch/offset state, grouping, a buffer for partial groups, save/load.

A plain class (the rollout manager wraps it in a Ray actor). Prompts are served in
``dataset.epoch_order(epoch, --rollout-seed, --rollout-shuffle)`` order; because that order depends only on
(dataset, seed, shuffle, epoch), the state to resume exactly is small: epoch, offset, two counters and the
buffered groups. ``save``/``load`` write it as ``DIR/iter_{rollout_id:07d}/data_source.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path
from typing import Any

from vime.utils.checkpoint_layout import iteration_dir, write_json_atomic
from vime.utils.data import PromptDataset, load_prompt_dataset
from vime.utils.misc import load_function
from vime.utils.types import Sample, Status

STATE_VERSION = 1
STATE_FILE = "data_source.json"


class RolloutDataSource:
    """Serves groups of ``--n-samples-per-prompt`` copies of each prompt, epoch after epoch.

    Groups handed back with :meth:`add_samples` (aborted partial rollouts, unused over-sampled groups) are
    served first, unchanged, before new prompts are drawn. With ``--disable-rollout-global-dataset`` there is no
    dataset: new groups are empty samples (slime), for a rollout function that makes its own prompts.
    """

    def __init__(
        self, args: argparse.Namespace, tokenizer: Any, dataset: PromptDataset | None = None
    ) -> None:
        self.args = args
        if dataset is None and getattr(args, "rollout_global_dataset", True):
            dataset = load_prompt_dataset(
                args.prompt_data,
                tokenizer,
                input_key=args.input_key,
                label_key=args.label_key,
                metadata_key=args.metadata_key,
                tool_key=args.tool_key,
                apply_chat_template=args.apply_chat_template,
                chat_template_kwargs=args.apply_chat_template_kwargs,
                max_prompt_len=args.rollout_max_prompt_len,
                keep_messages=getattr(args, "loss_type", "policy_loss") == "sft_loss",
            )
        self.dataset: PromptDataset | None = dataset
        self.epoch_id = 0  # completed passes over the dataset = the epoch the next prompt comes from
        self.offset = 0  # position of the next prompt in this epoch's order
        self.next_group_index = 0
        self.next_sample_index = 0
        self.buffer: list[list[Sample]] = []
        path = getattr(args, "buffer_filter_path", None)
        self.buffer_filter = (
            load_function(path, "--buffer-filter-path")
            if path
            else pop_oldest
            if getattr(args, "buffer_sort_by_staleness", False)
            else None
        )
        self._order: tuple[int, list[int]] | None = None  # (epoch, order) cache

    @property
    def num_rollout_per_epoch(self) -> int:
        """Rollout steps per pass over the dataset: ``len(dataset) // --rollout-batch-size``.

        Rounded down: the remaining prompts are not dropped, they open the next step, so a batch may span an
        epoch boundary. Multiply by ``--num-epoch`` to get ``--num-rollout``; 0 when the dataset is smaller
        than one batch (or without a dataset).
        """
        return len(self.dataset) // self.args.rollout_batch_size if self.dataset is not None else 0

    @property
    def buffer_size(self) -> int:
        """Number of groups waiting in the buffer."""
        return len(self.buffer)

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        """``num_groups`` groups: buffered groups first (FIFO; oldest weight version first with
        ``--buffer-sort-by-staleness``; as ``--buffer-filter-path`` picks), then fresh prompts in epoch order."""
        if num_groups < 0:
            raise ValueError(f"num_groups must be >= 0, got {num_groups}")
        if self.buffer_filter is not None:  # slime's --buffer-filter-path: takes its groups out of the buffer
            groups = list(self.buffer_filter(self.args, None, self.buffer, num_groups))
            if len(groups) > num_groups:
                raise ValueError(f"--buffer-filter-path returned {len(groups)} groups for {num_groups} asked")
        else:
            groups = self.buffer[:num_groups]
            del self.buffer[:num_groups]
        while len(groups) < num_groups and self.dataset is None:
            groups.append(self._make_group(Sample()))
        while len(groups) < num_groups:
            order = self._epoch_order()
            prompt = self.dataset.samples[order[self.offset]]
            self.offset += 1
            if self.offset == len(order):
                self.epoch_id, self.offset = self.epoch_id + 1, 0
            groups.append(self._make_group(prompt))
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Queue groups to be served first, as they are, by the next :meth:`get_samples` calls."""
        for position, group in enumerate(groups):
            if not group or not all(isinstance(sample, Sample) for sample in group):
                types = sorted({type(item).__name__ for item in group})
                raise ValueError(
                    f"add_samples: group {position} must be a non-empty list of Sample, got {len(group)} "
                    f"items of types {types}"
                )
        self.buffer.extend(groups)

    def _epoch_order(self) -> list[int]:
        if self._order is None or self._order[0] != self.epoch_id:
            order = self.dataset.epoch_order(self.epoch_id, self.args.rollout_seed, self.args.rollout_shuffle)
            self._order = (self.epoch_id, order)
        return self._order[1]

    def _make_group(self, prompt: Sample) -> list[Sample]:
        group = []
        for _ in range(self.args.n_samples_per_prompt):
            sample = copy.deepcopy(prompt)
            sample.group_index = self.next_group_index
            sample.index = self.next_sample_index
            sample.metadata["prompt_index"] = prompt.index
            sample.status = Status.PENDING
            self.next_sample_index += 1
            group.append(sample)
        self.next_group_index += 1
        return group

    def _fingerprint(self) -> dict[str, Any]:
        # The prompt order is a function of these; resuming with any of them changed would not be exact.
        return {
            "num_prompts": len(self.dataset) if self.dataset is not None else None,
            "spec": self.args.prompt_data,
            "rollout_seed": self.args.rollout_seed,
            "rollout_shuffle": self.args.rollout_shuffle,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: see :meth:`load_state_dict` for the checks on load."""
        return {
            "version": STATE_VERSION,
            "dataset": self._fingerprint(),
            "epoch_id": self.epoch_id,
            "offset": self.offset,
            "next_group_index": self.next_group_index,
            "next_sample_index": self.next_sample_index,
            "buffer": [[sample.to_dict() for sample in group] for group in self.buffer],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; state made for another dataset, seed or shuffle raises."""
        expected = {
            "version",
            "dataset",
            "epoch_id",
            "offset",
            "next_group_index",
            "next_sample_index",
            "buffer",
        }
        if missing := expected - set(state):
            raise ValueError(f"data-source state lacks {sorted(missing)}; it has {sorted(state)}")
        if state["version"] != STATE_VERSION:
            raise ValueError(f"data-source state version {state['version']}; this vime reads {STATE_VERSION}")
        saved, current = state["dataset"], self._fingerprint()
        if saved != current:
            differ = ", ".join(
                f"{key}: saved {saved.get(key)!r} vs now {current[key]!r}"
                for key in current
                if saved.get(key) != current[key]
            )
            raise ValueError(
                f"data-source state was saved for prompts {saved.get('spec')!r} ({saved.get('num_prompts')} prompts) "
                f"but this run has {current['spec']!r} ({current['num_prompts']} prompts); differs in {differ}. "
                "Resume with the same --prompt-data, --rollout-max-prompt-len, --rollout-seed and --rollout-shuffle"
            )
        if self.dataset is not None and not 0 <= state["offset"] < len(self.dataset):
            raise ValueError(f"data-source state offset {state['offset']} outside [0, {len(self.dataset)})")
        self.epoch_id = state["epoch_id"]
        self.offset = state["offset"]
        self.next_group_index = state["next_group_index"]
        self.next_sample_index = state["next_sample_index"]
        self.buffer = [[Sample.from_dict(sample) for sample in group] for group in state["buffer"]]

    def save(self, rollout_id: int, save_dir: str | os.PathLike, state: dict[str, Any] | None = None) -> Path:
        """Write the state (or an earlier ``state_dict()``) to ``save_dir/iter_{rollout_id:07d}/data_source.json``
        atomically; return the path."""
        path = state_path(save_dir, rollout_id)
        write_json_atomic(path, state if state is not None else self.state_dict())
        return path

    def load(self, rollout_id: int, load_dir: str | os.PathLike) -> None:
        """Restore the state that :meth:`save` wrote for ``rollout_id`` under ``load_dir``."""
        path = state_path(load_dir, rollout_id)
        if not path.is_file():
            raise FileNotFoundError(
                f"data-source state not found: {path} (written by --save at rollout {rollout_id}); "
                "check --load / --ckpt-step"
            )
        try:
            self.load_state_dict(json.loads(path.read_text(encoding="utf-8")))
        except ValueError as exc:  # includes JSONDecodeError
            raise ValueError(f"{path}: {exc}") from exc


def oldest_weight_version(group: list[Sample]) -> int | None:
    """The oldest policy a group's responses come from: the smallest integer weight version any of its samples
    records (slime writes them as strings, vime as ints; other tags such as ``"default"`` say nothing); None for a
    group never generated."""
    versions = [
        int(version)
        for sample in group
        for version in sample.weight_versions
        if str(version).removeprefix("-").isdigit()
    ]
    return min(versions, default=None)


def pop_oldest(
    args: argparse.Namespace, rollout_id: int | None, buffer: list[list[Sample]], num_groups: int
) -> list[list[Sample]]:
    """``--buffer-sort-by-staleness`` (slime): sort the buffer by :func:`oldest_weight_version`, stalest first and
    groups without a version last (ties keep their order), and take the first ``num_groups``; the rest stay
    buffered in that order. Resuming the oldest partial responses first bounds how stale they get. Has the
    ``--buffer-filter-path`` signature."""

    def staleness_order(group: list[Sample]) -> tuple[bool, int]:
        version = oldest_weight_version(group)
        return version is None, version or 0

    buffer.sort(key=staleness_order)
    taken = buffer[:num_groups]
    del buffer[:num_groups]
    return taken


def state_path(directory: str | os.PathLike, rollout_id: int) -> Path:
    """``directory/iter_{rollout_id:07d}/data_source.json``."""
    return iteration_dir(directory, rollout_id) / STATE_FILE
