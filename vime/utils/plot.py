"""Plot a run's ``metrics.jsonl``: reward (train and eval) and the train/rollout logprob gap vs rollout."""

from __future__ import annotations

import json
import os
from pathlib import Path

from vime.utils.tracking import METRICS_FILE

TRAIN_REWARD = "rollout/reward_mean"
LOGPROB_DIFF = "train/train_rollout_logprob_abs_diff"


def _read_series(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Every numeric key of the JSONL as ``(rollout_id, value)`` points sorted by rollout_id.

    Null (non-finite) values are dropped; a rollout_id logged twice (a resumed run appends) keeps its last value.
    """
    series: dict[str, dict[int, float]] = {}
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                rollout_id = int(record["rollout_id"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{line_no}: not a metrics record with a rollout_id ({e})") from e
            for key, value in record.items():
                if key not in ("rollout_id", "time") and isinstance(value, int | float):
                    series.setdefault(key, {})[rollout_id] = float(value)
    return {key: sorted(points.items()) for key, points in series.items()}


def plot_run(run_dir: str | os.PathLike, out_png: str | os.PathLike | None = None) -> Path:
    """Write a PNG (default ``run_dir/metrics.png``) of reward and logprob diff vs rollout_id; returns its path."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics file; is {run_dir} a vime run directory (--log-dir)?")
    series = _read_series(path)
    if not series:
        raise ValueError(f"{path}: no metrics logged yet")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_reward, ax_diff) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    reward_keys = [TRAIN_REWARD] + sorted(
        k for k in series if k.startswith("eval/") and k.endswith("/mean_reward")
    )
    for key in reward_keys:
        if key in series:
            xs, ys = zip(*series[key], strict=True)
            label = "train" if key == TRAIN_REWARD else f"eval {key.split('/')[1]}"
            ax_reward.plot(xs, ys, marker="o" if key != TRAIN_REWARD else None, markersize=3, label=label)
    ax_reward.set_ylabel("mean reward")
    ax_reward.grid(alpha=0.3)
    if ax_reward.lines:
        ax_reward.legend()
    positive = [(x, y) for x, y in series.get(LOGPROB_DIFF, []) if y > 0]
    if positive:
        xs, ys = zip(*positive, strict=True)
        ax_diff.plot(xs, ys, color="tab:red")
        ax_diff.set_yscale("log")
    else:
        ax_diff.text(0.5, 0.5, f"no positive {LOGPROB_DIFF} logged", ha="center", transform=ax_diff.transAxes)
    ax_diff.set_ylabel("|train - rollout| logprob")
    ax_diff.set_xlabel("rollout_id")
    ax_diff.grid(alpha=0.3)
    fig.suptitle(str(Path(run_dir).resolve().name))
    fig.tight_layout()
    out = Path(out_png) if out_png is not None else Path(run_dir) / "metrics.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
