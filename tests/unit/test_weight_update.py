"""A weight update as one call (vime.ray.weight_update), with a fake manager and training groups and fake engines
that score the check sequence and report their weights' checksums over HTTP: a sync runs its steps in order, a sync
an engine died in is done again once, stranded replacements get the rollout's weights, and the weights check (the
checksums, then the log-prob probe) runs on every path that admits an engine (a mismatch admits none)."""

from __future__ import annotations

import argparse
import json
import re
from types import SimpleNamespace

import pytest
import ray
from aiohttp import web
from fake_http import serve_posts

from vime.ray.weight_update import WeightUpdate
from vime.utils import weight_check
from vime.utils.async_utils import run
from vime.utils.run_context import RunContext

TRAINER = "trainer"
ROLLOUT = "kept copy"
# What the fake engines' workers recorded (url -> the version a push brought them) and which changed since
RECORDED: dict[str, int] = {}
CHANGED: set[str] = set()


class FakeManager:
    """The rollout manager's side, its engines serving weight ``version``: records each step in ``calls``."""

    def __init__(
        self, args, log_dir, calls: list, urls: list[str], stranded: list[str] | None = None, version: int = 0
    ):
        self.args, self.log_dir, self.calls, self.urls, self.stranded = (
            args,
            log_dir,
            calls,
            urls,
            stranded or [],
        )
        self.run_context = RunContext(weight_version=version)

    def stranded_engines(self) -> list[str]:
        return self.stranded

    def control(self):
        """The push runs inside it (the engine monitor then leaves the busy cores alone): its calls are marked."""
        return _Marked(self.calls)

    def wake_up(self, tags):
        self.calls.append(("wake_up", *tags))

    def before_weight_update(self):
        self.calls.append(("before_weight_update",))

    def ensure_engines_healthy(self):
        self.calls.append(("ensure_engines_healthy",))

    def engine_urls(self):
        self.calls.append(("engine_urls",))
        return self.urls

    def set_weight_version(self, version, urls):
        self.calls.append(("set_weight_version", version, urls))


class _Marked:
    """Marks the calls made inside :meth:`FakeManager.control` with a trailing ``"(control)"``."""

    def __init__(self, calls: list):
        self.calls = calls

    def __enter__(self):
        self.start = len(self.calls)

    def __exit__(self, *exc_info):
        self.calls[self.start :] = [(*call, "(control)") for call in self.calls[self.start :]]


class FakeGroup:
    """A training group: pushes (failing as told), scores the check sequence, offloads."""

    def __init__(self, name: str, calls: list, fail_pushes: int = 0):
        self.name, self.calls, self.fail_pushes = name, calls, fail_pushes

    def sync_weights(self, urls, version, disk_dir):
        self.calls.append(("sync_weights", urls, version, disk_dir))
        if self.fail_pushes:
            self.fail_pushes -= 1
            raise ray.exceptions.RayTaskError(
                "sync_weights", "EngineControlError: engine died", RuntimeError()
            )
        RECORDED.update(dict.fromkeys(urls, version))
        return {"weight_sync/time_s": 0.5, "weight_sync/engines": float(len(urls))}

    def push_rollout_weights(self, urls, version, disk_dir, tokens):
        self.calls.append(("push_rollout_weights", urls, version, disk_dir))
        RECORDED.update(dict.fromkeys(urls, version))
        return {"weight_sync/time_s": 0.5}, scores(ROLLOUT, tokens)

    def sequence_log_probs(self, tokens):
        self.calls.append(("sequence_log_probs",))
        return scores(TRAINER, tokens)

    def offload(self):
        self.calls.append((f"{self.name}.offload",))
        return {"offload/freed_gb": 1.0}


def scores(weights: str, tokens: list[int]) -> list[float]:
    """The check sequence's log-probs under ``weights`` (each set scores differently)."""
    return [-0.1 * (len(weights) % 7 + 1) * (i + 1) for i in range(len(tokens) - 1)]


def checksum_report(url: str) -> dict:
    """A fake one-worker engine's answer to ``check_weights_checksums``."""
    names, sums = ["embed.weight", "layers.0.qkv_proj.weight"], [11, 22]
    changed = ["layers.0.qkv_proj.weight", 22, 23] if url in CHANGED else None
    return {
        "version": RECORDED.get(url),
        "names": names,
        "checksums": sums,
        "layout": "2 tensors",
        "changed": changed,
    }


@pytest.fixture
def engines(tmp_path):
    """Start fake engines: ``engines(weights, ...)`` gives one URL per engine, each scoring as ``weights``, and
    reporting the checksums of two tensors (all alike), as recorded by the last push to it (:data:`RECORDED`)
    and changed since if in :data:`CHANGED`."""
    runners = []
    RECORDED.clear()
    CHANGED.clear()

    def start(*held: str) -> list[str]:
        urls = []
        for weights in held:

            async def completions(request: web.Request, weights=weights) -> web.Response:
                tokens = (await request.json())["prompt"]
                logprobs = [None] + [
                    {str(token): {"logprob": lp}}
                    for token, lp in zip(tokens[1:], scores(weights, tokens), strict=True)
                ]
                return web.json_response({"choices": [{"prompt_logprobs": logprobs}]})

            me: list[str] = []  # its URL, once it serves

            async def collective_rpc(request: web.Request, me=me) -> web.Response:
                assert (await request.json())["method"] == "check_weights_checksums"
                return web.json_response({"results": [checksum_report(me[0])]})

            routes = {"/v1/completions": completions, "/collective_rpc": collective_rpc}
            runner, url = run(serve_posts(routes))
            me.append(url)
            runners.append(runner)
            urls.append(url)
        return urls

    yield start
    for runner in runners:
        run(runner.cleanup())


@pytest.fixture
def args(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    return argparse.Namespace(
        hf_checkpoint=str(model), check_weight_update_equal=True, update_weight_dir=None,
        use_fault_tolerance=True, offload_train=True, rollout_external_engine_addrs=None, vllm_dtype="float32",
        bf16=False, fp16=False,
    )  # fmt: skip


class TimedCalls(list):
    """The fakes' call log, on the sync's clock: each call takes ``SECONDS[name]``."""

    SECONDS = {"wake_up": 1.0, "sync_weights": 10.0, "sequence_log_probs": 100.0, "actor.offload": 1000.0}

    def __init__(self):
        super().__init__()
        self.now = 0.0

    def append(self, call: tuple) -> None:
        super().append(call)
        self.now += self.SECONDS.get(call[0], 0.0)


def test_a_sync_runs_its_steps_in_order_and_checks_every_engine(args, tmp_path, engines, monkeypatch):
    calls = TimedCalls()
    monkeypatch.setattr("vime.ray.weight_update.time", SimpleNamespace(monotonic=lambda: calls.now))
    urls = engines(TRAINER, TRAINER)
    update = WeightUpdate(
        FakeManager(args, tmp_path, calls, urls, version=6),
        FakeGroup("actor", calls),
        FakeGroup("critic", calls),
    )
    version, metrics = update.update()
    assert version == 7  # one after the version the engines served
    sync_dir = str(tmp_path / "weight_sync")
    assert calls == [
        ("wake_up", "weights"),
        ("before_weight_update",),
        ("ensure_engines_healthy",),
        ("engine_urls",),
        (
            "sync_weights",
            urls,
            7,
            sync_dir,
            "(control)",
        ),  # the engine monitor leaves the cores alone meanwhile
        ("sequence_log_probs",),  # the trainer's side of the check, before its weights leave the GPU
        ("critic.offload",),
        ("actor.offload",),
        ("wake_up", "kv_cache"),
        ("set_weight_version", 7, urls),
    ]
    assert metrics.pop("weight_sync/check_s") == 0.0  # the check's HTTP takes no time on this clock
    # the first wake call -> the engines resumed (the wake and the push), apart from the check and the offload
    assert metrics == {
        "time/sync_s": 1112.0, "weight_sync/weights_wake_s": 1.0, "weight_sync/wake_to_resume_s": 11.0,
        "weight_sync/check_trainer_s": 100.0, "weight_sync/kv_cache_wake_s": 1.0,
        "weight_sync/time_s": 0.5, "weight_sync/engines": 2.0, "fault/sync_retries": 0.0, "offload/freed_gb": 1.0,
        "weight_sync/check_abs_diff": 0.0,
    }  # fmt: skip


def test_a_sync_an_engine_died_in_is_done_again_once(args, tmp_path, engines):
    calls: list = []
    urls = engines(TRAINER)
    manager = FakeManager(args, tmp_path, calls, urls, version=2)
    _, metrics = WeightUpdate(manager, FakeGroup("actor", calls, fail_pushes=1), None).update()
    assert [call[0] for call in calls].count("ensure_engines_healthy") == 2  # the dead engine replaced first
    assert metrics["fault/sync_retries"] == 1.0 and calls[-1] == ("set_weight_version", 3, urls)

    calls.clear()
    with pytest.raises(ray.exceptions.RayTaskError):  # twice: the run stops
        WeightUpdate(manager, FakeGroup("actor", calls, fail_pushes=2), None).update()
    assert not [call for call in calls if call[0] == "set_weight_version"]


@pytest.mark.parametrize(("kept", "pushed"), [(True, "push_rollout_weights"), (False, "sync_weights")])
def test_stranded_replacements_get_the_rollouts_weights_checked_then_admitted(
    args, tmp_path, engines, kept, pushed
):
    calls: list = []
    urls = engines(ROLLOUT if kept else TRAINER)
    # the kept copy is the version the engines serve; the actor's weights (trained since) are the next
    manager = FakeManager(args, tmp_path, calls, ["http://serving"], stranded=urls, version=5 if kept else 4)
    update = WeightUpdate(manager, FakeGroup("actor", calls), None)
    version, metrics = update.update(True, rollout_weights=kept, new_version=not kept)
    assert version == 5
    assert [call[0] for call in calls] == [
        "wake_up",
        "before_weight_update",
        pushed,
        *([] if kept else ["sequence_log_probs"]),
        "set_weight_version",
    ]
    assert calls[2][1:3] == (urls, 5) and calls[-1] == ("set_weight_version", 5, urls)
    assert metrics["weight_sync/check_abs_diff"] == 0.0


def test_nothing_is_pushed_while_no_replacement_is_stranded(args, tmp_path):
    calls: list = []
    update = WeightUpdate(
        FakeManager(args, tmp_path, calls, ["http://serving"], version=4), FakeGroup("actor", calls), None
    )
    assert update.update(stranded=True) == (4, {}) and calls == []


@pytest.mark.parametrize("path", ["sync", "stranded", "stranded, kept copy"])
def test_an_engine_off_the_pushed_weights_stops_the_update_and_is_not_admitted(args, tmp_path, engines, path):
    calls: list = []
    expected = ROLLOUT if path == "stranded, kept copy" else TRAINER
    good, bad = engines(expected, "other weights")
    stranded = [good, bad] if path != "sync" else None
    kept = path == "stranded, kept copy"
    manager = FakeManager(args, tmp_path, calls, [good, bad], stranded, version=2 if kept else 1)
    update = WeightUpdate(manager, FakeGroup("actor", calls), None)
    with pytest.raises(RuntimeError, match=f"after weight sync 2 .*{re.escape(bad)}") as raised:
        update.update(stranded is not None, rollout_weights=kept, new_version=not kept)
    assert good not in str(raised.value)
    assert not [call for call in calls if call[0] == "set_weight_version"]


@pytest.mark.parametrize("path", ["sync", "stranded", "stranded, kept copy"])
@pytest.mark.parametrize("fault", ["never pushed", "changed after the push"])
def test_an_engine_whose_checksums_fail_stops_the_update_naming_engine_and_tensor(
    args, tmp_path, engines, path, fault
):
    """The engines score the check sequence alike; one engine's checksums tell it does not hold the pushed weights
    (it never recorded this version, or a tensor changed since it loaded them): the update stops naming it (and the
    tensor), before the probe, and admits no engine."""
    calls: list = []
    kept = path == "stranded, kept copy"
    good, bad = engines(*[ROLLOUT if kept else TRAINER] * 2)
    stranded = [good, bad] if path != "sync" else None
    manager = FakeManager(args, tmp_path, calls, [good, bad], stranded, version=2 if kept else 1)
    group = FakeGroup("actor", calls)
    if fault == "never pushed":
        push = group.sync_weights if not kept else group.push_rollout_weights
        setattr(group, push.__name__, lambda urls, *rest: push([good], *rest))  # the push misses the second
        message = rf"engine {re.escape(bad)} worker 0 holds weights recorded by another sync \(none since it started"
    else:
        CHANGED.add(bad)
        message = (
            rf"engine {re.escape(bad)} worker 0: layers\.0\.qkv_proj\.weight changed since the sync loaded it"
        )
    update = WeightUpdate(manager, group, None)
    with pytest.raises(RuntimeError, match=rf"after weight sync 2 engines do not hold .*{message}") as raised:
        update.update(stranded is not None, rollout_weights=kept, new_version=not kept)
    assert good not in str(raised.value)
    assert not [call for call in calls if call[0] == "set_weight_version"]


def test_a_replacement_pushed_alone_is_compared_with_the_engines_checked_at_its_version(
    args, tmp_path, engines
):
    """A stranded replacement given the version the other engines were checked at must hold what they held."""
    calls: list = []
    first, replacement = engines(ROLLOUT, ROLLOUT)
    manager = FakeManager(args, tmp_path, calls, [first], version=1)
    update = WeightUpdate(manager, FakeGroup("actor", calls), None)
    update.actor.sequence_log_probs = lambda tokens: scores(ROLLOUT, tokens)
    assert update.update()[0] == 2
    manager.stranded, manager.run_context.weight_version = [replacement], 2
    reports = {replacement: [checksum_report(replacement) | {"version": 2, "checksums": [11, 99]}]}
    with pytest.raises(
        RuntimeError, match=r"layers\.0\.qkv_proj\.weight differs from the same tensor of engine"
    ):
        weight_check.compare_checksums(reports, 2, update.checked[1])
    assert update.update(True, rollout_weights=True, new_version=False)[0] == 2  # the same checksums pass


def test_no_check_without_the_flag(args, tmp_path, engines):
    args.check_weight_update_equal = False
    calls: list = []
    urls = engines("other weights")
    _, metrics = WeightUpdate(
        FakeManager(args, tmp_path, calls, urls), FakeGroup("actor", calls), None
    ).update()
    assert "weight_sync/check_abs_diff" not in metrics and ("sequence_log_probs",) not in calls
    assert "weight_sync/check_s" not in metrics


def test_a_sync_with_no_engine_up_pushes_nothing_and_admits_none(args, tmp_path):
    """Every engine died after the rollout and no replacement is up yet: they get the weights once stranded."""
    calls: list = []
    manager = FakeManager(args, tmp_path, calls, [], version=5)
    _, metrics = WeightUpdate(manager, FakeGroup("actor", calls), None).update()
    assert "sync_weights" not in [call[0] for call in calls] and calls[-1] == ("set_weight_version", 6, [])
    assert metrics["weight_sync/engines"] == 0.0
