"""Kill every process a process started once it dies, even by SIGKILL.

``python -m vime.utils.reaper PID`` (a child of PID) notes the processes descending from PID every
:data:`INTERVAL_S` seconds, each by pid and start time. When PID dies Linux sends the reaper SIGTERM
(``PR_SET_PDEATHSIG``) and it SIGKILLs each noted process still alive. A run starts one for its own local Ray
instance (``vime.ray.run.init_ray``): when the driver is SIGKILLed, Ray's GCS and raylet die at once but its dashboard
and runtime-env agents live on for about a minute (they try to report the raylet's death to the dead GCS).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

import psutil

PR_SET_PDEATHSIG = 1
INTERVAL_S = 2.0


def term_on_parent_death() -> None:
    """Have Linux SIGTERM the calling process when its parent (the thread that started it) dies; no-op elsewhere."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def start_reaper() -> subprocess.Popen:
    """Start a reaper for this process (call it from the main thread: the death signal follows the calling
    thread)."""
    return subprocess.Popen(  # no inherited stdout/stderr: a caller reading the driver's output waits for EOF
        [sys.executable, "-m", __name__, str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


class ParentDied(Exception):
    """Raised by the SIGTERM handler :func:`arm_parent_death` installs: it interrupts any sleep at once and cannot
    deadlock (an Event.set() in a signal handler can, on the lock that Event.wait() holds in the interrupted
    frame)."""


def _parent_died(signum: int, frame: object) -> None:
    raise ParentDied


def arm_parent_death() -> None:
    """Raise :class:`ParentDied` in the main thread when this process's parent dies (or it is SIGTERMed)."""
    signal.signal(signal.SIGTERM, _parent_died)
    term_on_parent_death()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m vime.utils.reaper PID", file=sys.stderr)
        return 2
    parent = int(argv[0])
    arm_parent_death()
    noted: dict[int, float] = {}  # pid -> start time, of every descendant seen and still alive
    try:
        if os.getppid() != parent:  # it died before the death signal was armed
            return 1
        _note_descendants(parent, noted)
    except ParentDied:
        pass
    for pid, started in noted.items():
        if _same(pid, started):
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
    return 0


def _note_descendants(parent: int, noted: dict[int, float]) -> None:
    """Every :data:`INTERVAL_S` seconds, add ``parent``'s descendants to ``noted`` (and forget those that exited),
    until ``parent`` is gone (or :class:`ParentDied` interrupts)."""
    me = os.getpid()
    while True:
        # one by one: an interruption leaves at most an exited entry (skipped when killing)
        for pid in [pid for pid, started in noted.items() if not _same(pid, started)]:
            del noted[pid]
        try:
            process = psutil.Process(parent)
            if process.status() == psutil.STATUS_ZOMBIE:
                return
            for proc in process.children(recursive=True):
                if proc.pid != me:
                    noted.setdefault(proc.pid, proc.create_time())
        except psutil.NoSuchProcess:
            return
        except psutil.Error:  # a child that exited during the walk
            pass
        time.sleep(INTERVAL_S)


def _same(pid: int, started: float) -> bool:
    """Whether process ``pid`` is alive and is the one that started at ``started`` (not a reuse of its pid)."""
    try:
        return psutil.Process(pid).create_time() == started
    except psutil.Error:
        return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
