"""``--use-fault-tolerance``: a health monitor that replaces dead or hung engines (DESIGN.md §4).

A background thread checks every engine each ``--rollout-health-check-interval`` seconds (after
``--rollout-health-check-first-wait``): its process must be alive, ``GET /health`` must answer 200 within
``--rollout-health-check-timeout`` seconds, so a hung (e.g. SIGSTOPped) server counts as dead, and so must the engine
core behind it (``GET /is_paused``, a call into the core: vLLM's ``/health`` only reports a core that crashed, not one
that hangs). The core is not asked while the engines run a control operation (:meth:`EngineMonitor.control`: a weight
sync, sleep or wake-up keeps it busy for as long as it takes; those calls have their own timeouts). A dead engine is
taken out of the router at once, stopped (its process group killed), and a new engine starts in the same slot
(the same GPUs; on a cluster a new actor in the same bundle: an engine whose actor died counts as dead) on a new
port. Nothing waits for it to start: weight syncs and rollouts go on with the other engines, and a later check
finds it up (or dead, or past ``--engine-start-timeout``: then it is replaced again). The new engine holds the
initial weights, so it stays out of the router until the first weight sync after it is up has given it the current
ones (:meth:`EngineMonitor.admit_synced`); requests that were in flight on the dead one are sent again by the
rollout (``vime.rollout.vllm_generate``). When no engine is left to serve (a run with one engine), the replacements
that are up are :meth:`EngineMonitor.stranded`: the driver gives them the weights during the rollout
(``vime.ray.run.Run.wait_rollout``) instead of at the next sync, which would never come.
An engine that dies more than ``--rollout-max-engine-restarts`` times stops the run with its log tail. A router
that vime started and that dies is restarted on its address with every admitted engine.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator

from vime.backends.vllm_utils import control_auth
from vime.backends.vllm_utils.engine import PORT_TAKEN, ServerProcess
from vime.backends.vllm_utils.engine_fleet import EngineHandle
from vime.backends.vllm_utils.router import (
    RouterError,
    RouterProcess,
    register_workers,
    start_router,
    unregister_worker,
)
from vime.utils.async_utils import run
from vime.utils.run_context import RunContext

logger = logging.getLogger(__name__)


class EngineMonitor:
    """Watches ``engines`` (a list it updates in place: slot ``i`` keeps its GPUs) behind the router at
    ``router_url``; ``make_engine(i)`` builds (not starts) the replacement of slot ``i``. The live engines go to the
    run context's ``engine_urls`` (where the rollout aborts requests) as they change."""

    def __init__(
        self,
        args,
        engines: list[EngineHandle],
        router_url: str,
        make_engine: Callable[[int], EngineHandle],
        run_context: RunContext,
        router: RouterProcess | None = None,
    ):
        self.args = args
        self.run_context = run_context
        self.engines = engines
        self.router_url = router_url
        self.router = router  # the router vime started (None: an external one, not restarted)
        self.router_restarts = 0
        self.make_engine = make_engine
        self.lock = threading.Lock()  # guards self.engines, starting and waiting_for_weights
        self._replacing = threading.Lock()  # one checker at a time: the thread or ensure_healthy
        # slot -> (when its engine died, when its replacement started): replacements not up yet
        self.starting: dict[int, tuple[float, float]] = {}
        # slots whose replacement is up, without the current weights
        self.waiting_for_weights: set[int] = set()
        self.restarts = [0] * len(engines)
        self.launches = [0] * len(engines)  # replacements started per slot (each logs to its own file)
        self.fatal: BaseException | None = None
        self.controlling = 0  # control operations under way (:meth:`control`): the engine cores are not asked
        # control operations begun so far: a core probe that overlapped one does not count
        self.controls_started = 0
        self.time_lost_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="vime-engine-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.args.engine_start_timeout + 30)

    def raise_if_fatal(self) -> None:
        """Re-raise, in the caller's thread, the error that stopped the monitor (a restart loop)."""
        if self.fatal is not None:
            raise self.fatal

    def metrics(self) -> dict[str, float]:
        return {
            "fault/engine_restarts": float(sum(self.restarts)),
            "fault/router_restarts": float(self.router_restarts),
            "fault/time_lost_s": self.time_lost_s,
        }

    def admit_synced(self, synced_urls: list[str] | None = None) -> None:
        """After a weight sync: the replacements it reached (``synced_urls``; None: every engine) rejoin the router.
        One made while the sync ran (its engine died during it) waits for the next sync, and so does one the router
        would not take (it did not answer the router's health check in time): the checks replace it if it is hung."""
        with self.lock:
            slots = sorted(
                i
                for i in self.waiting_for_weights
                if synced_urls is None or self.engines[i].url in synced_urls
            )
            self.waiting_for_weights -= set(slots)
        for slot in slots:
            url = self.engines[slot].url
            try:
                run(register_workers(self.router_url, [url]))
            except RouterError as exc:
                logger.warning(
                    "engine %s did not rejoin the router (%s); it waits for the next sync", url, exc
                )
                with self.lock:
                    if self.engines[slot].url == url:  # not replaced meanwhile
                        self.waiting_for_weights.add(slot)
                continue
            logger.info("engine %s rejoined the router with the current weights", url)

    def stranded(self) -> list[str]:
        """When no engine is left to serve the rollout: the URLs of the replacements that are up, waiting for
        weights (slot order; none while they all still start). Else none."""
        with self.lock:
            if len(self.waiting_for_weights) + len(self.starting) < len(self.engines):
                return []
            return [self.engines[slot].url for slot in sorted(self.waiting_for_weights)]

    def live_urls(self) -> list[str]:
        """The engines that are up (serving, or waiting for weights), in slot order: what a weight sync reaches."""
        with self.lock:
            return self._live_urls()

    def _live_urls(self) -> list[str]:  # under self.lock
        return [engine.url for slot, engine in enumerate(self.engines) if slot not in self.starting]

    @contextlib.contextmanager
    def control(self) -> Iterator[None]:
        """Around a control operation on the engines (weight sync, sleep, wake-up): their cores are busy with it, so
        the checks meanwhile ask only the API servers."""
        with self.lock:
            self.controlling += 1
            self.controls_started += 1
        try:
            yield
        finally:
            with self.lock:
                self.controlling -= 1

    def ensure_healthy(self) -> None:
        """Check every engine now: replace the dead ones, note the replacements that came up (before a weight
        sync, so it reaches every engine that is up). Never waits for a replacement to start."""
        self._check_all()
        self.raise_if_fatal()

    # ------------------------------------------------------------------------------------------ the thread
    def _watch(self) -> None:
        if self._stop.wait(self.args.rollout_health_check_first_wait):
            return
        while not self._stop.is_set() and self.fatal is None:
            self._check_all()
            self._stop.wait(self.args.rollout_health_check_interval)

    def _check_all(self) -> None:
        """Every slot at once, each in its own thread, and the router's liveness beside them: one slot's probe (up
        to ``--rollout-health-check-timeout`` for a hung engine) or replacement (seconds: the dead engine stopped, a
        new one launched) does not hold up another's (one after another, the second engine of a double kill was
        replaced 9 s after the first on 2 cores). A dead router is restarted after the slot checks, with the engines
        that just passed them: a hung engine's probe is waited out once (probed again for the router, it held the
        router's restart, and the rollout, for a second timeout)."""
        with self._replacing:
            with concurrent.futures.ThreadPoolExecutor(len(self.engines) + 1, "vime-engine-check") as pool:
                router = self.router
                router_down = (
                    pool.submit(self._down_reason, router, "/liveness") if router is not None else None
                )
                list(pool.map(self._check_slot, range(len(self.engines))))
            if router_down is None or self._stop.is_set() or self.fatal is not None:
                return
            if reason := router_down.result():
                try:
                    self._restart_router(reason)
                except BaseException as e:  # noqa: BLE001 -- handed to the run's thread
                    self.fatal = e

    def _check_slot(self, slot: int) -> None:
        if self._stop.is_set() or self.fatal is not None:
            return
        try:
            if slot in self.starting:
                self._check_start(slot)
            elif reason := self._down_reason(self.engines[slot]) or self._core_problem(self.engines[slot]):
                self._replace(slot, reason)
        except BaseException as e:  # noqa: BLE001 -- handed to the run's thread
            self.fatal = e

    def _down_reason(self, server: EngineHandle | ServerProcess, path: str = "/health") -> str | None:
        """None when ``server``'s process is alive and ``GET path`` answers 200 within
        ``--rollout-health-check-timeout``; else what failed (for the log)."""
        if not server.is_alive():
            return "its process exited"
        return get_problem(urllib.request.Request(server.url + path), self.args.rollout_health_check_timeout)

    def _core_problem(self, engine: EngineHandle) -> str | None:
        """None when the engine core answers a call within ``--rollout-health-check-timeout``, or when a control
        operation (:meth:`control`) ran at any time during the probe (the core may be busy with it); else why not."""
        with self.lock:
            if self.controlling:
                return None
            controls_before = self.controls_started
        problem = core_problem(engine.url, self.args.rollout_health_check_timeout)
        if problem is None:
            return None
        with self.lock:
            if self.controlling or self.controls_started != controls_before:
                return None
        return f"a call into its engine core: {problem}, though GET /health answered"

    def _restart_router(self, reason: str) -> None:
        """A dead router (``reason``: what showed it) comes back on its address (the rollout keeps its URL) with
        every admitted engine."""
        started, dead = time.monotonic(), self.router
        logger.warning("the router at %s is dead or hung (%s); restarting it", dead.url, reason)
        dead.stop(grace_s=5.0)
        self.router_restarts += 1
        if self.router_restarts > self.args.rollout_max_engine_restarts:
            raise RuntimeError(
                f"the router died {self.router_restarts} times; last lines of {dead.log_path}:\n{dead.log_tail(40)}"
            )
        self.router = start_router(
            self.args, host=dead.host, port=dead.port,
            log_path=dead.log_path.with_name(f"router.restart{self.router_restarts}.log"),
        )  # fmt: skip
        with self.lock:
            admitted = [
                e
                for i, e in enumerate(self.engines)
                if i not in self.waiting_for_weights and i not in self.starting
            ]
        # each answered the check just made (a dead or hung one was replaced in it, and is starting): vllm-router's
        # POST /workers waits until a worker is healthy, so a hung one would hold the monitor
        run(register_workers(self.router_url, [e.url for e in admitted]))
        self.time_lost_s += time.monotonic() - started

    def _replace(self, slot: int, reason: str) -> None:
        """Take slot ``slot``'s dead engine out (``reason``: what showed it, for the log) and start its replacement
        (not waiting for it)."""
        dead = self.engines[slot]
        logger.warning("engine %d at %s is dead or hung (%s); replacing it", slot, dead.url, reason)
        try:
            run(unregister_worker(self.router_url, dead.url))
        except Exception as e:  # noqa: BLE001 -- the router may be restarting; the engine is gone anyway
            logger.warning("could not remove %s from the router: %s", dead.url, e)
        tail = dead.log_tail(40)
        # another process bound its free port before it did: a start lost, not an engine failure
        if PORT_TAKEN in tail:
            logger.warning("engine %d lost its port to another process; starting it on another one", slot)
        else:
            self.restarts[slot] += 1
        if self.restarts[slot] > self.args.rollout_max_engine_restarts:
            dead.stop(grace_s=1.0)
            raise RuntimeError(
                f"engine {slot} died {self.restarts[slot]} times (--rollout-max-engine-restarts "
                f"{self.args.rollout_max_engine_restarts}); last lines of {dead.log_path}:\n{tail}"
            )
        self.launches[slot] += 1
        # built before the dead one is stopped: an engine's Ray actor takes seconds to come up, which then overlap
        # the stop; it starts (and takes the slot's GPUs) only once the dead one is gone
        try:
            engine = self.make_engine(slot)
        finally:
            stopping = time.monotonic()
            dead.stop(grace_s=1.0)  # dead or hung: what is left of it gets no use out of a graceful stop
            logger.info("engine %d's dead server ended in %.2f s", slot, time.monotonic() - stopping)
        engine.start()
        now = time.monotonic()
        with self.lock:
            self.engines[slot] = engine
            # down since the first death when a replacement died while starting
            self.starting[slot] = (self.starting.get(slot, (now, now))[0], now)
            self.waiting_for_weights.discard(slot)
            self.run_context.engine_urls = self._live_urls()
        logger.warning("engine %d starting again at %s", slot, engine.url)

    def _check_start(self, slot: int) -> None:
        """A replacement that is up waits for weights; one that died or outlived ``--engine-start-timeout`` while
        starting is replaced again (it counts as a restart)."""
        engine, (down_since, launched) = self.engines[slot], self.starting[slot]
        reason = self._down_reason(engine)
        if reason is None:
            with self.lock:
                del self.starting[slot]
                self.waiting_for_weights.add(slot)
                self.run_context.engine_urls = self._live_urls()
                self.time_lost_s += time.monotonic() - down_since
            logger.warning("engine %d is up at %s; it rejoins after the next weight sync", slot, engine.url)
        elif not engine.is_alive():
            self._replace(slot, f"it exited while starting ({reason})")
        elif time.monotonic() - launched > self.args.engine_start_timeout:
            self._replace(
                slot, f"not up after --engine-start-timeout {self.args.engine_start_timeout} s ({reason})"
            )


def core_problem(url: str, timeout_s: float) -> str | None:
    """None when the engine at ``url`` gets an answer from its engine core (``GET /is_paused``, a call into the core
    that vLLM's ``/health`` does not make) within ``timeout_s``; else what went wrong."""
    request = urllib.request.Request(
        url + "/is_paused", headers={control_auth.HEADER: control_auth.run_secret()}
    )
    return get_problem(request, timeout_s)


def get_problem(request: urllib.request.Request, timeout_s: float) -> str | None:
    """None when ``request`` (a GET) answers 200 within ``timeout_s``; else what went wrong, for the log."""
    what = f"GET {urllib.parse.urlsplit(request.full_url).path}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout_s) as resp:
            return None if resp.status == 200 else f"{what} answered {resp.status}"
    except urllib.error.HTTPError as e:
        return f"{what} answered {e.code}"
    except OSError as e:
        if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
            return f"{what} got no answer within {timeout_s:g} s"
        return f"{what} failed ({e})"
