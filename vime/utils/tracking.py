"""Metrics sinks for a run: ``metrics.jsonl`` (always), TensorBoard and W&B (opt-in), and a console line."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import secrets
import time
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def _finite_or_none(value: Any) -> float | None:
    """``value`` as a float, or None when it is NaN/inf (JSON has no spelling for those)."""
    value = float(value)
    return value if math.isfinite(value) else None


def _require(module: str, flag: str, package: str) -> Any:
    """Import an optional package, naming the flag that asked for it when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{flag} needs the `{package}` package, which is not installed: "
            f"pip install {package}  (or pip install 'vime[tracking]')"
        ) from e


def format_train_line(rollout_id: int, num_rollout: int | None, metrics: dict[str, float]) -> str:
    """``[rollout 12/100] reward 0.53 | resp len 3.1 | logprob diff 2.1e-06 | time 4.2s (rollout 1.1 / ...)``.

    Parts whose keys are missing (or not finite) are left out. The total time is ``time/step_s`` when
    logged, else the sum of the phase times.
    """
    values = {k: v for k, v in ((k, _finite_or_none(v)) for k, v in metrics.items()) if v is not None}
    parts = [
        f"[rollout {rollout_id}/{num_rollout}]" if num_rollout is not None else f"[rollout {rollout_id}]"
    ]
    for key, label, spec in (
        ("rollout/reward_mean", "reward", ".3g"),
        ("rollout/response_length_mean", "resp len", ".1f"),
        ("train/train_rollout_logprob_abs_diff", "logprob diff", ".2g"),
        ("train/sft_loss", "sft loss", ".3g"),
        ("train/mismatch/k3", "mismatch k3", ".2g"),
        ("train/mismatch/tis_band_out_fraction", "out of TIS band", ".2g"),
    ):
        if key in values:
            parts.append(f"{label} {values[key]:{spec}}")
    phases = [
        (name, values[f"time/{name}_s"])
        for name in ("rollout", "rollout_wait", "train", "sync")
        if f"time/{name}_s" in values
    ]
    if phases or "time/step_s" in values:
        total = values.get("time/step_s", sum(seconds for _, seconds in phases))
        detail = " / ".join(f"{name} {seconds:.1f}" for name, seconds in phases)
        parts.append(f"time {total:.1f}s" + (f" ({detail})" if detail else ""))
    return parts[0] + " " + " | ".join(parts[1:]) if len(parts) > 1 else parts[0]


def format_eval_line(rollout_id: int, metrics: dict[str, float]) -> str:
    """``[eval rollout 12] gsm8k reward 0.61 (n=64) | math reward 0.2 (n=32)`` from ``eval/{name}/...`` keys."""
    names = [k.split("/")[1] for k in metrics if k.startswith("eval/") and k.endswith("/mean_reward")]
    parts = []
    for name in names:
        reward = _finite_or_none(metrics[f"eval/{name}/mean_reward"])
        text = f"{name} reward {reward:.3g}" if reward is not None else f"{name} reward n/a"
        if (n := metrics.get(f"eval/{name}/num_samples")) is not None:
            text += f" (n={int(n)})"
        parts.append(text)
    return f"[eval rollout {rollout_id}] " + (" | ".join(parts) if parts else "no eval/*/mean_reward metrics")


class Tracker:
    """Sends each step's metrics to ``run_dir/metrics.jsonl`` and, when enabled, TensorBoard and W&B.

    ``args`` uses ``--use-tensorboard``/``--tensorboard-dir`` and ``--use-wandb``/``--wandb-*``; missing attributes
    count as unset. ``num_rollout``: the run's rollout steps, for the console line.
    """

    def __init__(
        self, args: argparse.Namespace, run_dir: str | os.PathLike, num_rollout: int | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.num_rollout = num_rollout
        self._jsonl = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")  # closed in close()
        self._tb = None
        self._wandb_run = None
        self._step_scale = 1
        if getattr(args, "use_tensorboard", False):
            _require("tensorboard", "--use-tensorboard", "tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self._tensorboard_dir(args)))
        if getattr(args, "use_wandb", False):
            self._wandb_run = self._init_wandb(args)

    def _tensorboard_dir(self, args: argparse.Namespace) -> Path:
        """``--tensorboard-dir`` (else ``$TENSORBOARD_DIR``, else the run's ``tensorboard/``), then
        ``--tb-project-name`` / ``--tb-experiment-name`` below it."""
        root = getattr(args, "tensorboard_dir", None) or os.environ.get("TENSORBOARD_DIR")
        path = Path(root) if root else self.run_dir / "tensorboard"
        for part in (getattr(args, "tb_project_name", None), getattr(args, "tb_experiment_name", None)):
            path = path / part if part else path
        return path

    def _init_wandb(self, args: argparse.Namespace) -> Any:
        wandb = _require("wandb", "--use-wandb", "wandb")
        key, host = getattr(args, "wandb_key", None), getattr(args, "wandb_host", None)
        if key or host:
            wandb.login(key=key, host=host, relogin=bool(key))
        # Without an API key an online run would prompt or fail; offline keeps a local copy to `wandb sync`.
        mode = getattr(args, "wandb_mode", None) or os.environ.get("WANDB_MODE")
        mode = mode or ("online" if key or os.environ.get("WANDB_API_KEY") else "offline")
        save_dir = Path(
            getattr(args, "wandb_dir", None) or getattr(args, "wandb_save_dir", None) or self.run_dir
        )
        save_dir.mkdir(parents=True, exist_ok=True)
        config = {
            k: v if isinstance(v, int | float | str | bool | type(None)) else str(v)
            for k, v in vars(args).items()
            if k != "wandb_key"
        } | ({"num_rollout": self.num_rollout} if self.num_rollout is not None else {})
        name = getattr(args, "wandb_exp_name", None)
        if name and getattr(args, "wandb_random_suffix", False):  # as slime: distinct names for reruns
            name = f"{name}_{secrets.token_hex(4)}"
        self._step_scale = (
            args.num_steps_per_rollout if getattr(args, "wandb_always_use_train_step", False) else 1
        )
        run_id = getattr(args, "wandb_run_id", None)
        return wandb.init(
            project=getattr(args, "wandb_project", None) or "vime",
            entity=getattr(args, "wandb_team", None),
            group=getattr(args, "wandb_group", None),
            name=name,
            id=run_id,
            resume="allow" if run_id else None,
            dir=str(save_dir),
            mode=mode,
            config=config,
        )

    def _write(self, rollout_id: int, metrics: dict[str, float]) -> None:
        values = {k: _finite_or_none(v) for k, v in metrics.items()}
        record = {"rollout_id": rollout_id, "time": time.time(), **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in values.items():
                if value is not None:
                    self._tb.add_scalar(key, value, rollout_id)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log({k: float(v) for k, v in metrics.items()}, step=rollout_id * self._step_scale)

    def log(self, rollout_id: int, metrics: dict[str, float]) -> None:
        """Record one rollout step's metrics everywhere and print its status line."""
        self._write(rollout_id, metrics)
        print(format_train_line(rollout_id, self.num_rollout, metrics), flush=True)

    def log_eval(self, rollout_id: int, metrics: dict[str, float]) -> None:
        """Record eval metrics (``eval/{name}/...``) everywhere and print a short eval line."""
        self._write(rollout_id, metrics)
        print(format_eval_line(rollout_id, metrics), flush=True)

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        if not self._jsonl.closed:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
