"""slime's rollout hooks in the rollout manager (no engines: the rollout function only draws prompts):
``--custom-rollout-log-function-path`` sees every sample and can drop the default metrics, and
``--data-source-path`` swaps the data source class."""

from __future__ import annotations

import pytest

from vime.rollout.data_source import RolloutDataSource
from vime.rollout.rollout_manager import RolloutManager
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils.arguments import parse_args
from vime.utils.types import RolloutFnTrainOutput

SEEN: list[tuple] = []


def draw_prompts(args, rollout_id, data_source, evaluation=False):
    return RolloutFnTrainOutput(
        samples=data_source.get_samples(args.rollout_batch_size), metrics={"rollout/custom": 1.0}
    )


def log_and_skip(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    SEEN.append((rollout_id, len(samples), dict(rollout_extra_metrics), rollout_time >= 0))
    return rollout_id == 0  # skip the default metrics of rollout 0 only


class ReversedSource(RolloutDataSource):
    """Serves each batch's groups in reverse order."""

    def get_samples(self, num_groups):
        return super().get_samples(num_groups)[::-1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "model", seed=0, num_train=40)


def _args(model_dir, *extra):
    return parse_args(
        [
            "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--prompt-data",
            str(model_dir / "train.jsonl"), "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--num-rollout", "10", "--rollout-function-path", f"{__name__}.draw_prompts", *extra,
        ]
    )  # fmt: skip


def test_custom_rollout_log_function_sees_samples_and_can_drop_the_default_metrics(model_dir, tmp_path):
    SEEN.clear()
    args = _args(model_dir, "--custom-rollout-log-function-path", f"{__name__}.log_and_skip")
    manager = RolloutManager(args, tmp_path / "logs")
    assert manager.generate(0).metrics == {}
    assert manager.generate(1).metrics == {"rollout/custom": 1.0}
    assert SEEN == [(0, 8, {"rollout/custom": 1.0}, True), (1, 8, {"rollout/custom": 1.0}, True)]


def test_data_source_path_builds_the_given_class(model_dir, tmp_path):
    plain = RolloutManager(_args(model_dir), tmp_path / "a").generate(0)
    swapped_manager = RolloutManager(
        _args(model_dir, "--data-source-path", f"{__name__}.ReversedSource"), tmp_path / "b"
    )
    assert isinstance(swapped_manager.data_source, ReversedSource)
    swapped = swapped_manager.generate(0)
    order = [g[0].metadata["prompt_index"] for g in plain.samples]
    assert [g[0].metadata["prompt_index"] for g in swapped.samples] == order[::-1]
