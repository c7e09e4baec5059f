"""The reaper a run starts for its own local Ray: when the run's driver is SIGKILLed, every process it started dies,
also one already orphaned by its own parent's death (as Ray's agents are when the raylet dies first)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from vime.utils import reaper

# The "driver": starts a reaper, then a child ("raylet") whose own child ("agent") it reports, and waits.
DRIVER = """
import subprocess, sys, time
from vime.utils.reaper import start_reaper
start_reaper()
raylet = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
    "agent = subprocess.Popen(['sleep', '300']); print(agent.pid, flush=True); time.sleep(300)"], stdout=subprocess.PIPE)
print(raylet.pid, raylet.stdout.readline().decode().strip(), flush=True)
time.sleep(300)
"""


def test_a_sigkilled_driver_takes_its_orphaned_grandchildren_along():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        raylet, agent = (int(pid) for pid in driver.stdout.readline().split())
        time.sleep(reaper.INTERVAL_S * 2)  # the reaper has seen both
        os.kill(raylet, signal.SIGKILL)  # the agent is an orphan now, no longer the driver's descendant
        deadline = time.monotonic() + 10
        while psutil.Process(agent).ppid() == raylet and time.monotonic() < deadline:
            time.sleep(0.05)
        orphan = psutil.Process(agent)
        driver.kill()
        driver.wait()
        gone, alive = psutil.wait_procs([orphan], timeout=10)
        assert not alive, "the orphaned grandchild outlived the SIGKILLed driver"
    finally:
        driver.kill()
        for pid in (locals().get("raylet"), locals().get("agent")):
            if pid and psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_driver_that_exits_is_not_held_up_and_its_reaper_ends():
    """A caller reading the driver's output gets EOF when the driver exits (the reaper holds none of its pipes), and
    the reaper, told by the death signal, ends at once (its handler used to deadlock on the Event it waited on)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    code = "from vime.utils.reaper import start_reaper; import time; print(start_reaper().pid, flush=True); time.sleep(3)"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert time.monotonic() - started < 30
    try:
        reaper_process = psutil.Process(int(result.stdout.split()[0]))
    except psutil.NoSuchProcess:
        return  # already gone
    gone, alive = psutil.wait_procs([reaper_process], timeout=10)
    assert not alive, "the reaper outlived its driver"
