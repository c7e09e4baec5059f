"""The fault-tolerance engine monitor with fake engines and router (the real ones: tests/e2e/test_fault_tolerance.py):
a dead engine is taken out of the router and replaced on its slot without waiting for the replacement to start;
once up, the replacement is kept out until a weight sync; an engine that keeps dying (or never starts) stops the
run with its log."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

import pytest

from vime.backends.vllm_utils import engine_monitor
from vime.backends.vllm_utils.engine_monitor import EngineMonitor
from vime.utils.run_context import RunContext


class FakeEngine:
    def __init__(self, url: str, alive: bool = True):
        self.url, self.alive, self.log_path = url, alive, f"{url}.log"
        self.started = self.stopped = False
        self.up = True  # answers /health (False: alive, still starting)
        self.core_up = (
            True  # its engine core answers (False: hung behind a server that still answers /health)
        )

    def is_alive(self) -> bool:
        return self.alive

    def log_tail(self, n: int = 40) -> str:
        return f"last words of {self.url}"

    def stop(self, grace_s: float = 10.0) -> None:
        self.stopped = True

    def start(self):
        self.started = True
        return self


@pytest.fixture
def router(monkeypatch):
    calls = []

    async def unregister(router_url, url):
        calls.append(("remove", url))

    async def register(router_url, urls):
        calls.extend(("add", url) for url in urls)

    monkeypatch.setattr(engine_monitor, "unregister_worker", unregister)
    monkeypatch.setattr(engine_monitor, "register_workers", register)
    monkeypatch.setattr(
        EngineMonitor,
        "_down_reason",
        lambda self, server, path="/health": None if server.is_alive() and server.up else "down",
    )
    monkeypatch.setattr(
        engine_monitor,
        "core_problem",
        lambda url, timeout_s: None if CORES_UP.get(url, True) else "no answer",
    )
    return calls


CORES_UP: dict[str, bool] = {}  # url -> whether the fake engine's core answers (the fixture's core_problem)


def _monitor(engines, max_restarts=3):
    args = argparse.Namespace(
        rollout_max_engine_restarts=max_restarts, engine_start_timeout=5, rollout_health_check_timeout=1.0
    )
    made = []

    def make(slot):
        made.append(FakeEngine(f"new{slot}.{len(made)}"))
        return made[-1]

    run_context = RunContext(engine_urls=[engine.url for engine in engines])
    return EngineMonitor(args, engines, "http://router", make, run_context), made


def test_a_dead_engine_is_replaced_and_rejoins_after_a_sync(router):
    engines = [FakeEngine("e0"), FakeEngine("e1", alive=False)]
    monitor, made = _monitor(engines)
    monitor.ensure_healthy()
    assert engines[0].url == "e0" and engines[1] is made[0] and made[0].started
    assert router == [("remove", "e1")]  # out of the router at once; the replacement not yet in
    assert set(monitor.starting) == {1} and monitor.metrics()["fault/engine_restarts"] == 1.0
    assert monitor.live_urls() == ["e0"]  # a weight sync now goes on without the starting replacement
    assert monitor.run_context.engine_urls == ["e0"]  # and the rollout aborts requests on e0 only
    monitor.admit_synced()  # such a sync admits nothing
    assert router == [("remove", "e1")]
    monitor.ensure_healthy()  # it is up: the next sync reaches it
    assert monitor.starting == {} and monitor.waiting_for_weights == {1}
    assert monitor.live_urls() == ["e0", "new1.0"] == monitor.run_context.engine_urls
    monitor.admit_synced()
    assert router == [("remove", "e1"), ("add", "new1.0")] and monitor.waiting_for_weights == set()
    monitor.ensure_healthy()  # all healthy: nothing happens
    assert len(made) == 1


def test_dead_engines_are_replaced_side_by_side(router):
    """Both engines of a double kill are replaced at once: each stop here waits until the other has begun (one
    after another, the second engine's replacement began only once the first's had started, seconds later)."""
    both_stopping = threading.Barrier(2, timeout=5)

    class SlowToStop(FakeEngine):
        def stop(self, grace_s: float = 10.0) -> None:
            both_stopping.wait()
            super().stop(grace_s)

    engines = [SlowToStop("e0", alive=False), SlowToStop("e1", alive=False)]
    monitor, made = _monitor(engines)
    monitor.ensure_healthy()
    assert len(made) == 2 and all(engine.started for engine in made) and set(monitor.starting) == {0, 1}


def test_the_replacement_is_built_while_the_dead_engine_stops(router):
    """make_engine (a Ray actor that takes seconds to come up) runs before the dead engine's stop, and the
    replacement starts after it."""
    events = []

    class Recorded(FakeEngine):
        def stop(self, grace_s: float = 10.0) -> None:
            events.append(("stop", self.url))

        def start(self):
            events.append(("start", self.url))
            return self

    engines = [Recorded("e0", alive=False)]
    monitor, _ = _monitor(engines)
    monitor.make_engine = lambda slot: events.append(("make", slot)) or Recorded(f"new{slot}")
    monitor.ensure_healthy()
    assert events == [("make", 0), ("stop", "e0"), ("start", "new0")]


def test_an_engine_that_keeps_dying_stops_the_run_with_its_log(router):
    engines = [FakeEngine("e0", alive=False)]
    monitor, made = _monitor(engines, max_restarts=1)
    monitor.ensure_healthy()  # first restart allowed
    made[0].alive = False
    with pytest.raises(RuntimeError, match=r"(?s)engine 0 died 2 times .*last words of new0.0"):
        monitor.ensure_healthy()


def test_a_replacement_that_never_comes_up_is_replaced_again(router, monkeypatch):
    engines = [FakeEngine("e0"), FakeEngine("e1", alive=False)]
    monitor, made = _monitor(engines)
    monitor.ensure_healthy()
    made[0].up = False  # alive, not answering
    monitor.ensure_healthy()
    assert len(made) == 1 and set(monitor.starting) == {1}  # still within --engine-start-timeout (5 s)
    later = engine_monitor.time.monotonic() + 6
    monkeypatch.setattr(engine_monitor.time, "monotonic", lambda: later)
    monitor.ensure_healthy()
    assert engines[1] is made[1] and made[0].stopped and monitor.restarts == [0, 2]


def test_a_replacement_the_sync_did_not_reach_waits_for_the_next(router):
    """An engine replaced while a sync ran (it died during it) has the old weights: only synced ones rejoin."""
    engines = [FakeEngine("e0", alive=False), FakeEngine("e1", alive=False)]
    monitor, made = _monitor(engines)
    monitor.ensure_healthy()
    monitor.ensure_healthy()  # both replacements are up
    new0, new1 = engines
    assert {new0, new1} == set(made)
    monitor.admit_synced(["e0", new1.url])  # the sync saw e0's old URL and e1's replacement
    assert router[-1] == ("add", new1.url) and monitor.waiting_for_weights == {0}
    monitor.admit_synced([new0.url, new1.url])
    assert router[-1] == ("add", new0.url) and monitor.waiting_for_weights == set()


def test_replacements_are_stranded_only_when_no_engine_is_left_to_serve(router):
    engines = [FakeEngine("e0"), FakeEngine("e1", alive=False)]
    monitor, made = _monitor(engines)
    monitor.ensure_healthy()
    monitor.ensure_healthy()  # e1's replacement is up
    assert monitor.stranded() == []  # e0 still serves: the replacement waits for the next sync
    engines[0].alive = False
    monitor.ensure_healthy()  # e0's replacement is starting: only e1's can get weights now
    assert monitor.stranded() == [made[0].url]
    monitor.ensure_healthy()
    assert monitor.stranded() == [made[1].url, made[0].url]  # slot order
    monitor.admit_synced(monitor.stranded())
    assert monitor.stranded() == [] and monitor.waiting_for_weights == set()


def test_a_restarted_router_gets_only_the_engines_that_passed_the_check(router, monkeypatch):
    """A router and an engine fail together: vllm-router's POST /workers would wait for a hung engine to become
    healthy, so the restarted router gets the live engines only; the hung one is replaced in the same check, its
    probe made once (a second one, for the router, held the router's restart for another timeout)."""

    class FakeRouter(FakeEngine):
        host, port = "127.0.0.1", 1

        def __init__(self, url, alive=True):
            super().__init__(url, alive)
            self.log_path = Path("/tmp") / f"{url}.log"

    monkeypatch.setattr(engine_monitor, "start_router", lambda *a, **k: FakeRouter("router2"))
    probed = []
    down_reason = EngineMonitor._down_reason  # the fixture's

    def counted(self, server, path="/health"):
        probed.append(server.url)
        return down_reason(self, server, path)

    monkeypatch.setattr(EngineMonitor, "_down_reason", counted)
    engines = [FakeEngine("e0"), FakeEngine("e1", alive=False)]
    monitor, made = _monitor(engines)
    monitor.router = FakeRouter("router1", alive=False)
    monitor.ensure_healthy()
    assert sorted(probed) == ["e0", "e1", "router1"]  # each once
    assert monitor.router.url == "router2" and monitor.router_restarts == 1
    assert router == [("remove", "e1"), ("add", "e0")]  # the hung engine never reached the new router
    assert engines[1] is made[0] and set(monitor.starting) == {1}


def test_an_engine_whose_core_hangs_is_replaced_unless_a_control_operation_keeps_it_busy(router):
    engines = [FakeEngine("e0"), FakeEngine("e1")]
    monitor, made = _monitor(engines)
    CORES_UP["e1"] = False  # /health still answers: only a call into the core tells
    try:
        with monitor.control():  # e.g. a weight sync loading weights into the cores: nothing is replaced
            monitor.ensure_healthy()
            assert made == [] and router == []
        monitor.ensure_healthy()
        assert engines[1] is made[0] and router == [("remove", "e1")]
    finally:
        CORES_UP.clear()


def test_a_core_probe_that_overlapped_a_control_operation_does_not_count(router, monkeypatch, caplog):
    """A sync that begins while the probe waits keeps the core busy past the timeout: not a hang."""
    engines = [FakeEngine("e0")]
    monitor, made = _monitor(engines)

    def probe_during_a_sync(url, timeout_s):
        with monitor.control():
            return "no answer"

    monkeypatch.setattr(engine_monitor, "core_problem", probe_during_a_sync)
    monitor.ensure_healthy()
    assert made == [] and router == []
    monkeypatch.setattr(engine_monitor, "core_problem", lambda url, timeout_s: "GET /is_paused: no answer")
    with caplog.at_level("WARNING"):
        monitor.ensure_healthy()
    assert made and "a call into its engine core: GET /is_paused: no answer" in caplog.text


def test_get_problem_says_what_went_wrong():
    """200: no problem; another status, a refused connection and a silent server each named as such."""
    import socket
    import threading
    import urllib.request
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts, never answers
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert engine_monitor.get_problem(urllib.request.Request(url + "/health"), 5) is None
        assert (
            engine_monitor.get_problem(urllib.request.Request(url + "/is_paused"), 5)
            == "GET /is_paused answered 503"
        )
        silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}/health"
        assert (
            engine_monitor.get_problem(urllib.request.Request(silent_url), 0.2)
            == "GET /health got no answer within 0.2 s"
        )
    finally:
        server.shutdown()
        server.server_close()
        silent.close()
    refused = engine_monitor.get_problem(urllib.request.Request(url + "/health"), 1)
    assert refused.startswith("GET /health failed (") and "refused" in refused, refused


def test_a_replacement_the_router_will_not_take_waits_for_the_next_sync(router, monkeypatch):
    engines = [FakeEngine("e0", alive=False), FakeEngine("e1", alive=False)]
    monitor, made = _monitor(engines)
    monitor.ensure_healthy()
    monitor.ensure_healthy()  # both replacements up, waiting for weights
    assert monitor.waiting_for_weights == {0, 1}
    new0, new1 = engines  # replaced side by side: made in either order
    refused = {new0.url}

    async def register(router_url, urls):
        if set(urls) & refused:
            raise engine_monitor.RouterError(f"vllm-router POST /workers {urls} failed: TimeoutError()")
        router.extend(("add", url) for url in urls)

    monkeypatch.setattr(engine_monitor, "register_workers", register)
    monitor.admit_synced()  # the run goes on: the other one joins, the refused one waits
    assert ("add", new1.url) in router and ("add", new0.url) not in router
    assert monitor.waiting_for_weights == {0}
    refused.clear()
    monitor.admit_synced()  # the next sync admits it
    assert ("add", new0.url) in router and monitor.waiting_for_weights == set()


def test_a_replacement_that_lost_its_port_starts_again_without_counting_a_restart(router):
    engines = [FakeEngine("e0", alive=False)]
    monitor, made = _monitor(engines, max_restarts=1)
    monitor.ensure_healthy()  # e0 died: a restart
    assert monitor.metrics()["fault/engine_restarts"] == 1.0
    made[0].alive = False  # the replacement exits while starting: its free port was taken before it bound it
    made[0].log_tail = lambda n=40: "OSError: [Errno 98] Address already in use"
    monitor.ensure_healthy()  # started again on another port; not a second restart (max 1 would end the run)
    assert len(made) == 2 and monitor.metrics()["fault/engine_restarts"] == 1.0
    assert monitor.launches == [2]  # each start still logs to its own file (rollout_manager names it by this)
    made[1].alive = False  # any other death while starting still counts
    with pytest.raises(RuntimeError, match="died 2 times"):
        monitor.ensure_healthy()
