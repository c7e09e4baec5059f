"""End a process group: a server, its workers and whatever they forked (vLLM's API server, engine core and
workers share the process group of the process guard that started them)."""

from __future__ import annotations

import os
import signal
import time

import psutil


def group_members(group: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of process group ``group``, the caller excluded."""
    me = os.getpid()
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


def end_group(group: int, grace_s: float, kill_wait_s: float = 5.0) -> tuple[int, list[int]]:
    """SIGTERM every member of ``group`` (not the caller), SIGKILL those still alive after ``grace_s`` seconds.
    Returns how many members there were, and the pids still alive ``kill_wait_s`` seconds after the SIGKILL. It
    reaps none of them (a caller's child keeps its exit status for its own ``wait``)."""
    found = 0
    alive: list[psutil.Process] = []
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        members = group_members(group)
        found = found or len(members)
        for proc in members:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
        deadline = time.monotonic() + wait_s
        while (alive := group_members(group)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not alive:
            break
    return found, [proc.pid for proc in alive]
