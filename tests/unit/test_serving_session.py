"""``--rollout-session-id`` without a cluster: the flags it refuses, when a run keeps its engines (a failure) or
stops them and frees the session (a normal end), and when a run may adopt a kept engine (fake actors)."""

from __future__ import annotations

import argparse
import contextlib

import pytest

from vime.backends.vllm_utils.engine import engine_command
from vime.ray import engine_actor, serving_session
from vime.ray import run as run_module
from vime.ray.run import Run
from vime.utils.arguments import parse_args

BASE = ["--train-backend", "fsdp", "--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--num-rollout", "1"]
BASE += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-session-id", "s1"]


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        parse_args(argv)
    return capsys.readouterr().err


def test_flags_a_session_cannot_keep(capsys):
    assert parse_args(BASE).rollout_session_id == "s1"
    for flags in (["--colocate"], ["--offload-rollout"], ["--use-fault-tolerance"]):
        error = _refused([*BASE, *flags], capsys)
        assert "--rollout-session-id" in error and flags[0] in error, error
    external = _refused([*BASE, "--rollout-external-engine-addrs", "127.0.0.1:1"], capsys)
    assert "--rollout-external-engine-addrs" in external
    assert "letters, digits" in _refused([*BASE[:-1], "my session"], capsys)


class _Shutdown:
    def __init__(self, calls: list):
        self.calls = calls

    def remote(self, keep_engines: bool = False) -> None:
        self.calls.append(("shutdown", keep_engines))


class _Manager:
    def __init__(self, calls: list):
        self.shutdown = _Shutdown(calls)


class _Tracker:
    def close(self) -> None:
        pass


@pytest.fixture
def calls(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(run_module.ray, "get", lambda value: value)
    monkeypatch.setattr(run_module.ray, "shutdown", lambda: calls.append(("ray.shutdown",)))
    monkeypatch.setattr(serving_session, "release", lambda session: calls.append(("release", session)))
    return calls


def _run(calls: list, session: str | None, tmp_path) -> Run:
    args = argparse.Namespace(rollout_session_id=session, save=None)
    return Run(
        args,
        _Manager(calls),
        actor=None,
        critic=None,
        tracker=_Tracker(),
        log_dir=tmp_path,
        start_rollout_id=0,
        num_rollout=1,
    )


@pytest.mark.parametrize(
    ("session", "failed", "expected"),
    [
        ("s1", True, [("shutdown", True), ("ray.shutdown",)]),  # the engines stay for a resubmitted run
        (
            "s1",
            False,
            [("shutdown", False), ("release", "s1"), ("ray.shutdown",)],
        ),  # done: nothing left behind
        (None, True, [("shutdown", False), ("ray.shutdown",)]),  # no session: a failure stops everything
    ],
)
def test_a_failed_run_keeps_a_sessions_engines(calls, tmp_path, session, failed, expected):
    with pytest.raises(RuntimeError) if failed else contextlib.nullcontext():
        with _run(calls, session, tmp_path):
            if failed:
                raise RuntimeError("the trainer ran out of memory")
    assert calls == expected


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _KeptEngine:
    """A kept engine actor: ``info`` is what it reports; records the calls made on it."""

    def __init__(self, info: dict):
        self.calls: list = []
        self.session_info = _Remote(lambda: info)
        self.claim = _Remote(lambda job: self.calls.append(("claim", job)))


@pytest.fixture
def launcher(monkeypatch):
    """NodeEngines of session s1 with Ray faked: job ``j2`` runs this run, ``j1`` is over unless ``running``."""
    state: dict = {"kept": None, "running": set(), "killed": []}
    monkeypatch.setattr(engine_actor.ray, "get", lambda value, timeout=None: value)
    monkeypatch.setattr(engine_actor.ray, "kill", lambda actor: state["killed"].append(actor))
    monkeypatch.setattr(
        engine_actor.ray, "get_runtime_context", lambda: argparse.Namespace(get_job_id=lambda: "j2")
    )
    monkeypatch.setattr(serving_session, "job_is_running", lambda job: job in state["running"])

    def find_engine(session, slot):
        return None if state["killed"] else state["kept"]

    monkeypatch.setattr(serving_session, "find_engine", find_engine)
    return engine_actor.NodeEngines([], session="s1"), state


def test_a_run_adopts_a_kept_engine_only_as_it_would_start_it(launcher):
    nodes, state = launcher
    args = parse_args(BASE)
    command = engine_command(args, "127.0.0.1", 8100, extra_args=["--enable-scale-out"])
    info = {"host": "127.0.0.1", "port": 8100, "command": command, "alive": True, "owner": "j1"}
    state["kept"] = kept = _KeptEngine(info)
    assert nodes._kept(args, 0, ["--enable-scale-out"], None) is kept
    with pytest.raises(
        ValueError, match="--rollout-session-id s1: engine 0 runs .* resubmit with the session's"
    ):
        nodes._kept(args, 0, [], None)  # this run would start it without the flag
    state["running"].add("j1")
    with pytest.raises(RuntimeError, match="serves Ray job j1, which is still running"):
        nodes._kept(args, 0, ["--enable-scale-out"], None)
    info.update(alive=False)  # its server exited: the actor is ended and its name freed for a new engine
    assert nodes._kept(args, 0, ["--enable-scale-out"], None) is None and state["killed"] == [kept]


class _ActorClass:
    """Stands in for EngineActor: records the options each actor is made with."""

    def __init__(self):
        self.options_seen: list[dict] = []

    def options(self, **options):
        self.options_seen.append(options)
        return _Remote(lambda *args, **kwargs: _KeptEngine({}))


@pytest.mark.parametrize("session", [None, "s1"])
def test_only_a_sessions_engines_are_detached_named_actors(launcher, monkeypatch, session):
    from vime.ray.placement_group import EnginePlacement

    actors = _ActorClass()
    monkeypatch.setattr(engine_actor, "EngineActor", actors)
    monkeypatch.setattr(engine_actor, "RemoteEngine", lambda actor, placement, log_path: actor)
    placement = EnginePlacement(group=None, bundle_index=3, node_id="n", node_ip="127.0.0.1")
    nodes = engine_actor.NodeEngines([placement], session=session)
    engine = nodes.launch(parse_args(BASE), 0, "engine_0.log", [])
    [options] = actors.options_seen
    detached = {"name": "vime/s1/engine-0", "namespace": serving_session.NAMESPACE, "lifetime": "detached"}
    assert {k: v for k, v in options.items() if k != "scheduling_strategy"} == (
        {} if session is None else detached
    )
    assert engine.calls == ([] if session is None else [("claim", "j2")])
