"""The rollout-function lifecycle (vime.rollout.lifecycle) through the rollout manager, no engines: a user's rollout
function with hooks gets them at a weight update, a checkpoint, a resume and shutdown; one without runs unchanged."""

from __future__ import annotations

import argparse
import json

import pytest

from vime.rollout.lifecycle import STATE_FILE
from vime.rollout.rollout_manager import RolloutManager
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils.arguments import parse_args
from vime.utils.checkpoint_layout import iteration_dir
from vime.utils.types import RolloutFnTrainOutput

EVENTS: list[tuple] = []  # what the plug-ins below saw, in order


def plain_rollout(args, rollout_id, data_source, evaluation=False):
    """A rollout function without hooks."""
    return RolloutFnTrainOutput(samples=data_source.get_samples(args.rollout_batch_size))


class CountingRollout:
    """A rollout function with state: counts its calls, and records every hook."""

    def __init__(self, args, data_source):
        self.args, self.data_source, self.calls = args, data_source, 0
        self.run_context = None
        EVENTS.append(("init",))

    def __call__(self, args, rollout_id, data_source, evaluation=False, *, run_context):
        assert data_source is self.data_source
        self.run_context = run_context
        self.calls += 1
        EVENTS.append(("eval" if evaluation else "rollout", rollout_id))
        if evaluation:
            return {"task": {"rewards": [1.0], "truncated": [False], "samples": []}}
        return plain_rollout(args, rollout_id, data_source)

    def before_weight_update(self):
        EVENTS.append(("before_weight_update",))

    def after_weight_update(self, version):
        EVENTS.append(("after_weight_update", version, self.run_context.weight_version))

    def state_dict(self):
        EVENTS.append(("state_dict",))
        return {"calls": self.calls}

    def load_state_dict(self, state):
        EVENTS.append(("load_state_dict", state))
        self.calls = state["calls"]

    def stop(self):
        EVENTS.append(("stop",))


def hooked_eval(args, rollout_id, data_source, evaluation=False):
    """An eval function with one hook, as a function attribute."""
    return {"task": {"rewards": [0.0], "truncated": [False], "samples": []}}


hooked_eval.stop = lambda: EVENTS.append(("eval stop",))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "model", seed=0, num_train=40)


def make_args(model_dir, rollout_fn: str, *extra: str) -> argparse.Namespace:
    return parse_args(
        [
            "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--prompt-data",
            str(model_dir / "train.jsonl"), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--num-rollout", "10", "--rollout-function-path", f"{__name__}.{rollout_fn}", *extra,
        ]
    )  # fmt: skip


def test_a_rollout_function_with_hooks_gets_each_at_its_point(model_dir, tmp_path):
    EVENTS.clear()
    manager = RolloutManager(make_args(model_dir, "CountingRollout"), tmp_path / "logs")
    assert EVENTS == [("init",)]  # one instance, also serving eval
    manager.generate(0)
    manager.eval(0)
    manager.before_weight_update()
    manager.set_weight_version(3)
    manager.save(0, tmp_path / "ckpt")
    manager.shutdown()
    # first the state just before rollout 0 draws (a checkpoint of the rollout before would take it)
    assert EVENTS[1:] == [
        ("state_dict",),
        ("rollout", 0),
        ("eval", 0),
        ("before_weight_update",),
        ("after_weight_update", 3, 3),  # the manager's version is set first
        ("state_dict",),
        ("stop",),
    ]
    saved = json.loads((iteration_dir(tmp_path / "ckpt", 0) / STATE_FILE).read_text())
    assert saved == {"rollout": {"calls": 2}}

    EVENTS.clear()
    resumed = RolloutManager(make_args(model_dir, "CountingRollout"), tmp_path / "logs2")
    resumed.load(0, tmp_path / "ckpt")
    assert EVENTS == [("init",), ("load_state_dict", {"calls": 2})] and resumed.functions.rollout.calls == 2


def test_an_eval_function_of_its_own_gets_its_hooks_too(model_dir, tmp_path):
    EVENTS.clear()
    args = make_args(model_dir, "CountingRollout", "--eval-function-path", f"{__name__}.hooked_eval")
    manager = RolloutManager(args, tmp_path / "logs")
    assert manager.eval(0).data["task"]["rewards"] == [0.0]
    manager.shutdown()
    assert EVENTS == [("init",), ("stop",), ("eval stop",)]


def test_a_rollout_function_without_hooks_runs_unchanged(model_dir, tmp_path):
    manager = RolloutManager(make_args(model_dir, "plain_rollout"), tmp_path / "logs")
    assert manager.functions.rollout is plain_rollout is manager.functions.eval
    assert len(manager.generate(0).samples) == 2
    manager.before_weight_update()
    manager.set_weight_version(1)
    manager.save(0, tmp_path / "ckpt")
    assert not (iteration_dir(tmp_path / "ckpt", 0) / STATE_FILE).exists()  # no state, no file
    manager.shutdown()
    resumed = RolloutManager(make_args(model_dir, "plain_rollout"), tmp_path / "logs2")
    resumed.load(0, tmp_path / "ckpt")
    assert resumed.data_source.state_dict() == manager.data_source.state_dict()


def test_a_saved_state_no_function_loads_is_refused(model_dir, tmp_path):
    manager = RolloutManager(make_args(model_dir, "CountingRollout"), tmp_path / "logs")
    manager.generate(0)
    manager.save(0, tmp_path / "ckpt")
    plain = RolloutManager(make_args(model_dir, "plain_rollout"), tmp_path / "logs2")
    with pytest.raises(ValueError, match="--rollout-function-path that saved it"):
        plain.load(0, tmp_path / "ckpt")
