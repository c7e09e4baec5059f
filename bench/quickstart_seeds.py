"""The quick start's recipe over several seeds (CPU): when each run's 5-step mean reward first reaches 0.9.

Runs ``train.py`` with ``examples/quickstart``'s flags and ``--seed``/``--rollout-seed`` set to each seed, one run
after another (each takes the whole machine), and writes ``bench/results/quickstart_seeds_cpu.json``::

    python bench/quickstart_seeds.py --seeds 0-9 --out /tmp/quickstart_seeds
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def quickstart_argv(model_dir: Path, run_dir: Path) -> list[str]:
    spec = importlib.util.spec_from_file_location(
        "quickstart", REPO / "examples" / "quickstart" / "quickstart.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.quickstart_argv(model_dir, run_dir)


def run_seed(model_dir: Path, out: Path, seed: int) -> dict:
    """One quick-start run; its reward curve summarised."""
    run_dir = out / f"seed{seed}"
    argv = [*quickstart_argv(model_dir, run_dir), "--seed", str(seed), "--rollout-seed", str(seed)]
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *argv], cwd=REPO, capture_output=True, text=True
    )
    if result.returncode:
        raise RuntimeError(f"seed {seed}: train.py exited with {result.returncode}:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in open(run_dir / "logs" / "metrics.jsonl")]
    train = [r for r in records if "rollout/reward_mean" in r]
    rewards = [r["rollout/reward_mean"] for r in train]
    moving = [sum(rewards[i : i + 5]) / 5 for i in range(len(rewards) - 4)]
    return {
        "seed": seed,
        "wall_s": round(time.monotonic() - started, 1),
        "first_step_5_step_mean_ge_0.9": next((i + 4 for i, m in enumerate(moving) if m >= 0.9), None),
        "first_reward": round(rewards[0], 3),
        "max_5_step_mean": round(max(moving), 3),
        "last_5_step_mean": round(moving[-1], 3),
        "max_train_rollout_logprob_abs_diff": max(r["train/train_rollout_logprob_abs_diff"] for r in train),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0-9", help="a range A-B or a comma list")
    parser.add_argument("--out", type=Path, default=Path("/tmp/quickstart_seeds"), help="run directories")
    args = parser.parse_args()
    first, _, last = args.seeds.partition("-")
    seeds = list(range(int(first), int(last) + 1)) if last else [int(s) for s in args.seeds.split(",")]
    from vime.tools.make_tiny_model import build_tiny_model

    model_dir = build_tiny_model(args.out / "model", seed=0)
    runs = []
    for seed in seeds:
        runs.append(run_seed(model_dir, args.out, seed))
        print(json.dumps(runs[-1]), flush=True)
    reached = [r["first_step_5_step_mean_ge_0.9"] for r in runs]
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "device": "CPU",
        "command": f"python bench/quickstart_seeds.py --seeds {args.seeds}",
        "runs": runs,
        "reached_0.9": sum(step is not None for step in reached),
        "of": len(runs),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quickstart_seeds_cpu.json").write_text(json.dumps(summary, indent=1) + "\n")
    steps = [s for s in reached if s is not None]
    print(f"[bench] quick start: {summary['reached_0.9']}/{len(runs)} seeds reach a 5-step mean reward >= 0.9 "
          f"(steps {min(steps, default=None)}-{max(steps, default=None)})")  # fmt: skip


if __name__ == "__main__":
    main()
