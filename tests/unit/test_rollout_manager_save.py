"""The rollout manager's checkpoint of the data buffer when train_async.py has already started the next
rollout: the saved state is the one at the end of the checkpointed rollout, so a resume redraws the next
rollout's prompts instead of skipping them. No engine is started (a fake rollout function draws prompts)."""

from __future__ import annotations

import pytest

from vime.rollout.data_source import RolloutDataSource
from vime.rollout.rollout_manager import RolloutManager
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils.arguments import parse_args
from vime.utils.types import RolloutFnTrainOutput


def draw_prompts(args, rollout_id, data_source, evaluation=False):
    """A rollout function that only takes the batch's groups from the buffer."""
    return RolloutFnTrainOutput(samples=data_source.get_samples(args.rollout_batch_size))


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("m") / "model", seed=0, num_train=40)
    return parse_args(
        [
            "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--prompt-data",
            str(model_dir / "train.jsonl"), "--rollout-shuffle", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "2", "--num-rollout", "10",
            "--rollout-function-path", f"{__name__}.draw_prompts",
        ]
    )  # fmt: skip


def _prompts(output: RolloutFnTrainOutput) -> list[int]:
    return [group[0].metadata["prompt_index"] for group in output.samples]


@pytest.mark.parametrize("next_rollout_started", [True, False])
def test_save_holds_the_state_at_the_end_of_the_saved_rollout(args, tmp_path, next_rollout_started):
    manager = RolloutManager(args, tmp_path / "logs")
    manager.generate(0)
    upcoming = _prompts(manager.generate(1))
    if next_rollout_started:  # train_async.py: rollout 2 is generated before rollout 1's checkpoint
        manager.generate(2)
    manager.save(1, tmp_path / "ckpt")

    resumed = RolloutDataSource(args, None, manager.data_source.dataset)
    resumed.load(1, tmp_path / "ckpt")
    reference = RolloutManager(args, tmp_path / "ref_logs")
    for rollout_id in range(2):
        reference.generate(rollout_id)
    expected = _prompts(reference.generate(2))
    got = [group[0].metadata["prompt_index"] for group in resumed.get_samples(args.rollout_batch_size)]
    assert got == expected and got != upcoming
