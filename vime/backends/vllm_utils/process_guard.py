"""Run a server so that it never outlives the process that launched it.

``python -m vime.backends.vllm_utils.process_guard PARENT_PID -- COMMAND...`` runs COMMAND as a child in the
guard's own process group. When the launcher dies, even by SIGKILL (e.g. Ray tearing down the rollout manager
after the driver was killed), Linux sends the guard SIGTERM (``PR_SET_PDEATHSIG``): it stops COMMAND, then kills
whatever else is left in its process group (vLLM's engine core and workers are grandchildren that a killed API
server leaves behind). It does the same cleanup when COMMAND exits by itself, and exits with COMMAND's code once its
watchdog (below) is gone too, so nothing of the server outlives a guard that exited.
If the guard itself is SIGKILLed (Ray does that to a dead actor's direct children), COMMAND still gets SIGTERM (it
carries the same parent-death signal), and the guard's watchdog (``process_guard --watch GUARD_PID``, a child in a
session of its own, so Ray does not reach it) SIGKILLs whatever of the guard's process group is still alive
:data:`GRACE_S` seconds later: a vLLM server can hang in its SIGTERM shutdown and hold its GPU memory for hours.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Protocol

from vime.utils.process_group import end_group
from vime.utils.reaper import ParentDied, arm_parent_death, term_on_parent_death

GRACE_S = 10.0


def watch(guard_pid: int) -> int:
    """The watchdog: once the guard is gone, end what is left of its process group (nothing, when the guard
    exited normally: it cleans up before exiting)."""
    try:
        arm_parent_death()
        if os.getppid() == guard_pid:
            while True:
                time.sleep(3600)
    except ParentDied:
        pass
    left, _ = end_group(guard_pid, GRACE_S)
    if left:
        print(f"[process_guard] the guard died; ended the {left} processes left in its group", flush=True)
    return 0


class Child(Protocol):
    """What the guard needs of the process it runs (a :class:`subprocess.Popen`, or a forked one)."""

    def poll(self) -> int | None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


def start_watchdog() -> subprocess.Popen:
    """The guard's watchdog (``--watch``), in a session of its own so Ray does not reach it when it kills the guard."""
    return subprocess.Popen(
        [sys.executable, "-m", __spec__.name, "--watch", str(os.getpid())],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # out of the group the guard ends (and out of Ray's reach when it kills the guard)
    )


def supervise(
    start: Callable[[], Child], watchdog: subprocess.Popen, launcher_gone: Callable[[], bool] = lambda: False
) -> int:
    """Start the child (``start()``) and wait for it; on SIGTERM/SIGINT/SIGHUP (handled from before the start), or
    once ``launcher_gone()``, SIGTERM it and SIGKILL it :data:`GRACE_S` seconds later. Then end the guard's process
    group and its ``watchdog``; return the child's exit code (128 + signal number for a signal)."""
    kill_at: list[float] = []  # set once asked to stop: when to escalate to SIGKILL
    started: list[Child] = []

    def stop(_signum: int | None = None, _frame=None) -> None:
        if not kill_at:
            kill_at.append(time.monotonic() + GRACE_S)
            for child in started:
                child.terminate()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    started.append(child := start())
    if kill_at:  # asked to stop while it started
        child.terminate()
    while (returncode := child.poll()) is None:
        if not kill_at and launcher_gone():
            stop()
        if kill_at and time.monotonic() > kill_at[0]:
            child.kill()
        time.sleep(0.2)
    end_group(os.getpgrp(), GRACE_S)
    watchdog.kill()  # the group is ended: nothing left for it to do
    watchdog.wait()
    return returncode if returncode >= 0 else 128 - returncode


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--watch":
        return watch(int(argv[1]))
    if len(argv) < 3 or argv[1] != "--":
        print(
            "usage: python -m vime.backends.vllm_utils.process_guard PARENT_PID -- COMMAND...",
            file=sys.stderr,
        )
        return 2
    term_on_parent_death()
    if os.getppid() != int(argv[0]):  # the launcher died before the line above
        return 1
    watchdog = start_watchdog()
    # The command is SIGTERMed when the guard dies too: Ray SIGKILLs the direct children of a dead actor (the
    # guard), and a SIGTERMed vLLM server shuts its engine core down itself.
    return supervise(lambda: subprocess.Popen(argv[2:], preexec_fn=term_on_parent_death), watchdog)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
