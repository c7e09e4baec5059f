"""CPU seconds of one Ray start-up as a run makes it (``vime.ray.run.init_ray``): a driver starts the local
instance, creates one actor, calls it and shuts Ray down; every process started meanwhile (Ray's daemons, the
actor's worker, the reaper) is sampled every 0.2 s until it exits, and its last user+system CPU time counted.
Processes that live less than a sample period may be missed. Prints the CPU-s per process name of each repeat and
their mean, and writes them to ``bench/results/``.

    python bench/ray_startup_cost.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil

SAMPLE_S = 0.2
DRIVER = """
import argparse, sys, time, ray
from vime.ray.run import init_ray

@ray.remote(num_cpus=0)
class Echo:
    def ping(self, x):
        return x

args = argparse.Namespace(rollout_session_id=None, debug_rollout_only=True, debug_train_only=False,
                          advantage_estimator="grpo", colocate=False, rollout_num_gpus=1)
init_ray(args)
assert ray.get(Echo.remote().ping.remote(1)) == 1
time.sleep(float(sys.argv[1]))
ray.shutdown()
"""


def process_name(proc: psutil.Process) -> str:
    """The program a process runs: a binary's name, else the script (last two path parts) or ``-m`` module."""
    cmdline = proc.cmdline() or [proc.name()]
    if "python" not in Path(cmdline[0]).name:
        return Path(cmdline[0].split()[0]).name
    args = [arg for arg in cmdline[1:] if arg == "-m" or not arg.startswith("-")]
    if args[:1] == ["-m"]:
        return f"python -m {args[1]}"
    return "python " + "/".join(Path(args[0]).parts[-2:]) if args else "python"


def measure_once(hold_s: float) -> tuple[dict[str, float], dict[str, int], float]:
    """Run the driver once; CPU-s and process count per name of every process started meanwhile, and wall s."""
    started = time.monotonic()
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(hold_s)], cwd=Path(__file__).resolve().parents[1]
    )
    root = psutil.Process(driver.pid)
    tracked: dict[int, psutil.Process] = {driver.pid: root}
    cpu: dict[int, float] = {}
    names: dict[int, str] = {driver.pid: "driver (ray.init, one actor call, ray.shutdown)"}
    while True:
        try:  # the daemons are the driver's children (the actor's worker the raylet's): caught while it lives
            tracked |= {
                child.pid: child for child in root.children(recursive=True) if child.pid not in tracked
            }
        except psutil.Error:
            pass
        alive = 0
        for pid, proc in tracked.items():
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                times = proc.cpu_times()
                names.setdefault(pid, process_name(proc))
                cpu[pid] = times.user + times.system
                alive += 1
            except psutil.Error:
                continue
        if driver.poll() is not None and not alive:
            break
        time.sleep(SAMPLE_S)
    wall = time.monotonic() - started
    if driver.returncode:
        raise SystemExit(f"the driver failed (exit {driver.returncode})")
    by_name: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for key, seconds in cpu.items():
        by_name[names[key]] += seconds
        count[names[key]] += 1
    return dict(by_name), dict(count), wall


def report(runs: list[tuple[dict[str, float], dict[str, int], float]], label: str) -> None:
    """Print each process name's CPU-s per repeat, their mean and the process counts, then the totals."""
    names = sorted({name for by_name, _, _ in runs for name in by_name}, key=lambda n: -runs[0][0].get(n, 0))
    for name in names:
        values = [by_name.get(name, 0.0) for by_name, _, _ in runs]
        counts = [count.get(name, 0) for _, count, _ in runs]
        repeats = " ".join(f"{value:6.2f}" for value in values)
        print(f"{name[:60]:60s} {repeats}  mean {sum(values) / len(values):6.2f}  procs {counts}")
    totals = [sum(by_name.values()) for by_name, _, _ in runs]
    repeats = " ".join(f"{total:.2f}" for total in totals)
    walls = " ".join(f"{wall:.1f}" for _, _, wall in runs)
    print(f"[bench] {label}: CPU-s {repeats} (mean {sum(totals) / len(totals):.2f}), wall s {walls}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--hold", type=float, default=0.0, help="seconds the driver keeps Ray up after the call"
    )
    parser.add_argument("--label", default="current", help="the variant's name, in the result file's name")
    args = parser.parse_args()
    runs = [measure_once(args.hold) for _ in range(args.repeats)]
    report(runs, args.label)
    env = {key: os.environ.get(key) for key in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    result = {
        "label": args.label,
        "hold_s": args.hold,
        "env": env,
        "runs": [{"cpu_s": by_name, "procs": count, "wall_s": wall} for by_name, count, wall in runs],
    }
    out = (
        Path(__file__).resolve().parent
        / "results"
        / f"ray_startup_cost_{args.label}_{time.strftime('%Y%m%d')}.json"
    )
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
