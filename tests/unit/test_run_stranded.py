"""``Run._serve_stranded``: when no engine is left to serve a rollout, the replacements get the weights that rollout
is generated with: in ``train_async.py`` (the actor trained since the last sync) ``--keep-old-actor``'s kept copy at
the engines' version, else the actor's weights as the next version; in ``train.py`` the engines' version."""

from __future__ import annotations

import argparse

import pytest

from vime.ray import run as run_module
from vime.ray.run import Run


class _UpdateWeights:
    """The rollout manager's one-call sync: records its arguments; ``pushed``: whether any replacement was stranded
    (the manager, which counts the versions, answers the version it pushed and the sync's metrics)."""

    def __init__(self, pushed: bool):
        self.calls: list[dict] = []
        self.pushed = pushed

    def remote(self, **kwargs) -> tuple[int, dict]:
        self.calls.append(kwargs)
        return 5 + int(kwargs["new_version"]), ({"weight_sync/engines": 1.0} if self.pushed else {})


class _Manager:
    def __init__(self, pushed: bool):
        self.update_weights = _UpdateWeights(pushed)


def _run(manager: _Manager, keep_old_actor: bool, trained_since_sync: bool) -> Run:
    args = argparse.Namespace(keep_old_actor=keep_old_actor, debug_train_only=False)
    return Run(args, manager, actor=object(), critic=None, tracker=None, log_dir=None, start_rollout_id=0,
               num_rollout=1, trained_since_sync=trained_since_sync)  # fmt: skip


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    monkeypatch.setattr(run_module.ray, "get", lambda value: value)


@pytest.mark.parametrize(
    ("keep_old_actor", "trained_since_sync", "kept", "new_version", "still_ahead"),
    [
        # train_async.py with --keep-old-actor: the kept copy, the version the rollout began with; still a step behind
        (True, True, True, False, True),
        # train_async.py without it: the actor's weights, as the next version; the engines caught up with the actor
        (False, True, False, True, False),
        # train.py (nothing trained since the sync): the engines' version, with or without the flag
        (False, False, False, False, False),
        (True, False, False, False, False),
    ],
)
def test_stranded_replacements_get_the_rollouts_weights(
    keep_old_actor, trained_since_sync, kept, new_version, still_ahead
):
    manager = _Manager(pushed=True)
    run = _run(manager, keep_old_actor, trained_since_sync)
    run._serve_stranded()
    assert manager.update_weights.calls == [
        {"stranded": True, "rollout_weights": kept, "new_version": new_version}
    ]
    assert run.trained_since_sync is still_ahead


def test_nothing_changes_while_no_replacement_is_stranded():
    manager = _Manager(pushed=False)
    run = _run(manager, keep_old_actor=False, trained_since_sync=True)
    run._serve_stranded()
    assert manager.update_weights.calls == [{"stranded": True, "rollout_weights": False, "new_version": True}]
    assert run.trained_since_sync  # asked, but none was stranded: the run stays a version ahead
