"""Configuration and runtime apart (vime.utils.run_context): what a plug-in with slime's signature reads through the
view of ``args`` it is handed (the flags, and the run's router, engines and versions as they change), that what it
writes stays in its view, and which rollout and generate functions get the run context instead."""

from __future__ import annotations

import argparse
import copy
import pickle

import pytest

from vime.utils.run_context import (
    PluginArgs,
    RunContext,
    call_plugin,
    configuration,
    plugin_args,
    run_context_of,
    takes_run_context,
)


def _view() -> tuple[argparse.Namespace, RunContext, PluginArgs]:
    flags = argparse.Namespace(rollout_batch_size=4, vllm_router_ip=None, vllm_router_port=None)
    run = RunContext(router_ip="10.0.0.2", router_port=3000, engine_urls=["http://e0"], weight_version=2)
    return flags, run, PluginArgs(flags, run)


def test_the_view_answers_flags_and_the_runs_values_as_they_change():
    flags, run, view = _view()
    assert view.rollout_batch_size == 4
    assert (view.vllm_router_ip, view.vllm_router_port) == (view.sglang_router_ip, view.sglang_router_port)
    assert (view.sglang_router_ip, view.sglang_router_port) == ("10.0.0.2", 3000)  # not the flags' None
    assert view.rollout_engine_urls == ["http://e0"] and view.weight_version == 2
    run.engine_urls, run.weight_version = ["http://e1"], 3  # an engine replaced, a sync
    run.model_routers = {"policy": ("10.0.0.2", 3000)}
    assert view.rollout_engine_urls == ["http://e1"] and view.weight_version == 3
    assert view.vllm_model_routers == {"policy": ("10.0.0.2", 3000)}
    view.rollout_engine_urls.append("http://mine")  # a copy: the run's list is its own
    assert run.engine_urls == ["http://e1"]
    assert "rollout_batch_size" in view and "rollout_engine_urls" in view and "nope" not in view
    with pytest.raises(AttributeError, match="nope"):
        view.nope  # noqa: B018


def test_a_plugins_writes_stay_in_its_view_and_a_copy_is_a_writable_namespace():
    flags, run, view = _view()
    view.sample = None  # slime's multi-agent example keeps state on args
    view.rollout_batch_size = 8  # ... and adjusts flags for its own calls (args.rollout_max_context_len)
    view.sglang_router_port = 1  # even a runtime name: the plug-in's own business
    assert (view.sample, view.rollout_batch_size, view.sglang_router_port) == (None, 8, 1)
    assert flags.rollout_batch_size == 4 and not hasattr(flags, "sample") and run.router_port == 3000
    assert PluginArgs(flags, run).rollout_batch_size == 4  # another view sees the configuration
    assert vars(view)["rollout_batch_size"] == 8 and "sample" in view
    del view.sample, view.rollout_batch_size, view.sglang_router_port
    assert view.rollout_batch_size == 4 and "sample" not in view and view.sglang_router_port == 3000
    with pytest.raises(AttributeError, match="cannot delete args.rollout_batch_size"):
        del view.rollout_batch_size
    assert vars(view)["rollout_batch_size"] == 4 and vars(view)["sglang_router_port"] == 3000
    for snapshot in (copy.copy(view), copy.deepcopy(view), pickle.loads(pickle.dumps(view))):
        assert type(snapshot) is argparse.Namespace and snapshot.sglang_router_ip == "10.0.0.2"
        snapshot.rollout_batch_size = 8  # slime's `args = deepcopy(args)`, then changes to the copy
    assert view.rollout_batch_size == 4
    changed = argparse.Namespace(**{**vars(view), "rm_type": "math"})  # eval's per-dataset flags
    assert changed.rm_type == "math" and changed.rollout_engine_urls == ["http://e0"]


def test_the_run_context_is_found_behind_the_view_or_passed():
    flags, run, view = _view()
    assert plugin_args(view, RunContext()) is view and configuration(view) is flags is configuration(flags)
    assert run_context_of(view) is run and run_context_of(flags, run) is run
    with pytest.raises(ValueError, match="no run context: pass run_context="):
        run_context_of(flags)
    with pytest.raises(RuntimeError, match="no router address yet"):
        _ = RunContext().router_url
    assert run.router_url == "http://10.0.0.2:3000"


def vime_style(args, rollout_id, *, run_context):
    return args, run_context


def slime_style(args, rollout_id, evaluation=False):
    return args, None


class Stateful:
    def __call__(self, args, rollout_id, *, run_context):
        return args, run_context


def test_call_plugin_gives_vimes_functions_the_context_and_slimes_the_view():
    flags, run, view = _view()
    assert (
        takes_run_context(vime_style) and takes_run_context(Stateful()) and not takes_run_context(slime_style)
    )
    assert not takes_run_context(len)
    assert call_plugin(vime_style, flags, 0, run_context=run) == (flags, run)
    assert call_plugin(vime_style, view, 0, run_context=run) == (flags, run)  # the flags, not the view
    assert call_plugin(Stateful(), flags, 0, run_context=run) == (flags, run)
    got, _ = call_plugin(slime_style, flags, 0, run_context=run, evaluation=True)
    assert isinstance(got, PluginArgs) and got.sglang_router_port == 3000
