"""Run a server so that it never outlives the process that launched it.

``python -m vime.backends.vllm_utils.process_guard PARENT_PID -- COMMAND...`` runs COMMAND as a child in the
guard's own process group. When the launcher dies, even by SIGKILL (e.g. Ray tearing down the rollout manager
after the driver was killed), Linux sends the guard SIGTERM (``PR_SET_PDEATHSIG``): it stops COMMAND, then kills
whatever else is left in its process group (vLLM's engine core and workers are grandchildren that a killed API
server leaves behind). It does the same cleanup when COMMAND exits by itself, and exits with COMMAND's code.
If the guard itself is SIGKILLed, COMMAND still gets SIGTERM (it carries the same parent-death signal).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from vime.utils.reaper import term_on_parent_death

GRACE_S = 10.0


def _group_members() -> list[psutil.Process]:
    """Live processes of this process group other than the guard itself."""
    me, group = os.getpid(), os.getpgrp()
    members = []
    for proc in psutil.process_iter(["status"]):
        try:
            if (
                proc.pid != me
                and os.getpgid(proc.pid) == group
                and proc.info["status"] != psutil.STATUS_ZOMBIE
            ):
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            pass
    return members


def _kill_group(grace_s: float) -> None:
    """SIGTERM every other member of the group, SIGKILL those still alive after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        members = _group_members()
        for proc in members:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(members, timeout=wait_s)
        if not alive:
            return


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(
            "usage: python -m vime.backends.vllm_utils.process_guard PARENT_PID -- COMMAND...",
            file=sys.stderr,
        )
        return 2
    term_on_parent_death()
    if os.getppid() != int(argv[0]):  # the launcher died before the line above
        return 1
    # The command is SIGTERMed when the guard dies too: Ray SIGKILLs the direct children of a dead actor (the
    # guard), and a SIGTERMed vLLM server shuts its engine core down itself.
    child = subprocess.Popen(argv[2:], preexec_fn=term_on_parent_death)
    kill_at: list[float] = []  # set once asked to stop: when to escalate to SIGKILL

    def stop(_signum: int, _frame) -> None:
        if not kill_at:
            kill_at.append(time.monotonic() + GRACE_S)
            child.terminate()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    while (returncode := child.poll()) is None:
        if kill_at and time.monotonic() > kill_at[0]:
            child.kill()
        time.sleep(0.2)
    _kill_group(GRACE_S)
    return returncode if returncode >= 0 else 128 - returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
