"""``Run._serve_stranded``: when no engine is left to serve a rollout, the replacements get the weights that rollout
is generated with: in ``train_async.py`` (the actor trained since the last sync) ``--keep-old-actor``'s kept copy at
the engines' version, else the actor's weights as the next version; in ``train.py`` the engines' version."""

from __future__ import annotations

import argparse

import pytest

from vime.ray import run as run_module
from vime.ray.run import Run


class _Call:
    def __init__(self, calls: list, result: dict):
        self.calls, self.result = calls, result

    def remote(self, version: int, stranded: bool = False, rollout_weights: bool = False) -> dict:
        self.calls.append((version, stranded, rollout_weights))
        return self.result


class _Manager:
    """The rollout manager's one-call sync: records its arguments; ``pushed``: whether any replacement was stranded."""

    def __init__(self, pushed: bool):
        self.calls: list = []
        self.update_weights = _Call(self.calls, {"weight_sync/engines": 1.0} if pushed else {})


def _run(manager: _Manager, keep_old_actor: bool, trained_since_sync: bool) -> Run:
    args = argparse.Namespace(keep_old_actor=keep_old_actor, debug_train_only=False)
    return Run(args, manager, actor=object(), critic=None, tracker=None, log_dir=None, start_rollout_id=0,
               weight_version=5, trained_since_sync=trained_since_sync)  # fmt: skip


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    monkeypatch.setattr(run_module.ray, "get", lambda value: value)


@pytest.mark.parametrize(
    ("keep_old_actor", "trained_since_sync", "pushed_as", "after"),
    [
        # train_async.py with --keep-old-actor: the kept copy, the version the rollout began with; still a step behind
        (True, True, (5, True, True), (5, True)),
        # train_async.py without it: the actor's weights, as the next version; the engines caught up with the actor
        (False, True, (6, True, False), (6, False)),
        # train.py (nothing trained since the sync): the engines' version, with or without the flag
        (False, False, (5, True, False), (5, False)),
        (True, False, (5, True, False), (5, False)),
    ],
)
def test_stranded_replacements_get_the_rollouts_weights(keep_old_actor, trained_since_sync, pushed_as, after):
    manager = _Manager(pushed=True)
    run = _run(manager, keep_old_actor, trained_since_sync)
    run._serve_stranded()
    assert manager.calls == [pushed_as]
    assert (run.weight_version, run.trained_since_sync) == after


def test_nothing_changes_while_no_replacement_is_stranded():
    manager = _Manager(pushed=False)
    run = _run(manager, keep_old_actor=False, trained_since_sync=True)
    run._serve_stranded()
    assert manager.calls == [(6, True, False)]  # asked, but none was stranded: the run stays a version ahead
    assert (run.weight_version, run.trained_since_sync) == (5, True)
