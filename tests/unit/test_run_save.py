"""``Run.save``: a checkpoint is declared complete (``latest_checkpointed_iteration.txt``) only after everything that
belongs to it is written: the actor's and critic's iterations and the data buffer's state, the actor's marker last;
so a run killed in between resumes from the previous checkpoint instead of one without its data buffer."""

from __future__ import annotations

import argparse

import pytest

from vime.ray import run as run_module
from vime.ray.run import Run


class _Group:
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def save(self, rollout_id, save_dir, mark=True):
        self.calls.append((f"{self.name}.save", rollout_id, save_dir, mark))

    def mark_saved(self, rollout_id, save_dir):
        self.calls.append((f"{self.name}.mark_saved", rollout_id, save_dir))

    def export_hf(self, out_dir):
        self.calls.append((f"{self.name}.export_hf", out_dir))


class _Manager:
    def __init__(self, calls: list):
        self.save = argparse.Namespace(
            remote=lambda rollout_id, save_dir: calls.append(("data.save", rollout_id, save_dir))
        )


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    monkeypatch.setattr(run_module.ray, "get", lambda value: value)


@pytest.mark.parametrize("with_critic", [False, True])
def test_the_actors_marker_is_written_last(with_critic):
    calls: list = []
    args = argparse.Namespace(
        save="ckpt", critic_save="critic" if with_critic else None, save_hf="hf/{rollout_id}"
    )
    critic = _Group("critic", calls) if with_critic else None
    run = Run(args, _Manager(calls), actor=_Group("actor", calls), critic=critic, tracker=None, log_dir=None,
              start_rollout_id=0, num_rollout=4)  # fmt: skip
    run.save(3)
    want = [("actor.save", 3, "ckpt", False)]
    want += [("critic.save", 3, "critic", False)] if with_critic else []
    want += [("data.save", 3, "ckpt")]
    want += [("critic.mark_saved", 3, "critic")] if with_critic else []
    want += [("actor.mark_saved", 3, "ckpt"), ("actor.export_hf", "hf/3")]
    assert calls == want


def test_without_save_only_the_hf_export():
    calls: list = []
    args = argparse.Namespace(save=None, critic_save=None, save_hf="hf")
    Run(args, _Manager(calls), actor=_Group("actor", calls), critic=None, tracker=None, log_dir=None,
        start_rollout_id=0, num_rollout=1).save(0)  # fmt: skip
    assert calls == [("actor.export_hf", "hf")]
