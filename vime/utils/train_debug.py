"""Debugging aids around a training step, shared by both trainers (slime's flags): the ``--ci-*`` checks, the
``--save-debug-train-data`` dump and the ``--record-memory-history`` recorder."""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
from pathlib import Path
from typing import Any

import torch

KL_ZERO = 1e-8  # slime's bound for "the first step's KL is zero"


def ci_check_step(
    args: argparse.Namespace,
    role: str,
    rollout_id: int,
    step: int,
    metrics: dict[str, float],
    same_policy: bool,
) -> None:
    """``--ci-test`` (slime): a rollout's first step starts from the policy its old log-probs came from, so its
    ``ppo_kl`` is 0 (when ``same_policy``), and the run's first step has the reference equal to the policy, so
    ``kl_loss`` is 0 (``--ci-disable-kl-checker`` drops both); ``--ci-save-grad-norm`` / ``--ci-load-grad-norm``
    store or compare each step's grad norm. ``RuntimeError`` names the check that failed."""
    if args.ci_test and not args.ci_disable_kl_checker and role == "actor":
        if step == 0 and same_policy and abs(metrics.get("ppo_kl", 0.0)) >= KL_ZERO:
            raise RuntimeError(
                f"--ci-test: ppo_kl {metrics['ppo_kl']:.3g} at the first step of rollout {rollout_id}; the old "
                "log-probs must come from the policy being trained"
            )
        if rollout_id == 0 and step == 0 and abs(metrics.get("kl_loss", 0.0)) >= KL_ZERO:
            raise RuntimeError(
                f"--ci-test: kl_loss {metrics['kl_loss']:.3g} at the first step; the reference must start equal "
                "to the policy"
            )
    fields = {"role": role, "rollout_id": rollout_id, "step_id": step}
    if args.ci_save_grad_norm and _writes():
        path = Path(args.ci_save_grad_norm.format(**fields))
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(metrics["grad_norm"], path)
    elif args.ci_load_grad_norm:
        expected = float(torch.load(args.ci_load_grad_norm.format(**fields)))
        if not math.isclose(metrics["grad_norm"], expected, rel_tol=0.01, abs_tol=0.01):
            raise RuntimeError(
                f"--ci-load-grad-norm: {role} grad norm {metrics['grad_norm']:.6g} at rollout {rollout_id} step "
                f"{step}, saved {expected:.6g}"
            )


def ci_check_rollout(args: argparse.Namespace, metrics: dict[str, float]) -> None:
    """``--ci-test``: the trainer's old log-probs and the engine's agree within the threshold."""
    diff = metrics.get("train_rollout_logprob_abs_diff")
    if args.ci_test and diff is not None and diff > args.ci_train_rollout_logprob_abs_diff_threshold:
        raise RuntimeError(
            f"--ci-test: train_rollout_logprob_abs_diff {diff:.3g} is above "
            f"--ci-train-rollout-logprob-abs-diff-threshold {args.ci_train_rollout_logprob_abs_diff_threshold:g}"
        )


def _writes() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def save_train_data(path: str, rollout_id: int, rank: int, data: dict[str, Any]) -> Path:
    """``--save-debug-train-data``: one data-parallel rank's training inputs for a rollout (tensors on the CPU)."""
    out = Path(path.format(rollout_id=rollout_id, rank=rank))
    out.parent.mkdir(parents=True, exist_ok=True)

    def cpu(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().cpu()
        if isinstance(value, list):
            return [cpu(item) for item in value]
        return value

    torch.save({"rollout_id": rollout_id, "rank": rank, **{k: cpu(v) for k, v in data.items()}}, out)
    return out


class MemoryRecorder:
    """``--record-memory-history``: PyTorch's CUDA allocator history (``--memory-recorder torch``, viewable at
    pytorch.org/memory_viz) or memray's host-memory tracker, dumped after ``--memory-snapshot-num-steps``
    rollouts (torch: also on an out-of-memory error) into ``--memory-snapshot-dir``."""

    def __init__(self, args: argparse.Namespace, role: str, rank: int):
        self.args = args
        name = f"memory_snapshot_{role}_rank{rank}_{time.strftime('%Y%m%d-%H%M%S')}"
        suffix = ".pickle" if args.memory_recorder == "torch" else ".bin"
        self.path = Path(args.memory_snapshot_dir) / (name + suffix)
        self.active = False
        self._tracker = None

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.args.memory_recorder == "memray":
            if importlib.util.find_spec("memray") is None:
                raise ValueError(
                    "--memory-recorder memray: memray is not installed here (pip install memray)"
                )
            import memray

            self._tracker = memray.Tracker(str(self.path))
            self._tracker.__enter__()
        else:
            if not torch.cuda.is_available():
                raise ValueError(
                    "--record-memory-history with --memory-recorder torch records CUDA memory: this trainer has "
                    "no GPU (use --memory-recorder memray for host memory)"
                )
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="all")
            observer = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
            if observer is not None:
                observer(lambda *_: torch.cuda.memory._dump_snapshot(str(self.path)))
        self.active = True

    def after_rollout(self, rollout_id: int) -> Path | None:
        """Dump and stop once rollout ``--memory-snapshot-num-steps - 1`` has trained; the file, or None."""
        steps = self.args.memory_snapshot_num_steps
        if not self.active or steps is None or rollout_id != steps - 1:
            return None
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
        else:
            torch.cuda.memory._dump_snapshot(str(self.path))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.active = False
        return self.path
