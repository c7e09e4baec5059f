"""Tracker sinks (JSONL, TensorBoard, W&B offline), console lines, the metrics plot and ``vime plot``."""

from __future__ import annotations

import argparse
import builtins
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vime.utils.plot import _read_series, plot_run
from vime.utils.tracking import Tracker, format_eval_line, format_train_line

TRAIN = {
    "rollout/reward_mean": 0.53,
    "rollout/response_length_mean": 3.14,
    "train/train_rollout_logprob_abs_diff": 2.1e-6,
    "time/rollout_s": 1.1,
    "time/train_s": 2.6,
    "time/sync_s": 0.5,
}


def _args(**overrides) -> argparse.Namespace:
    base = dict(
        num_rollout=100,
        use_tensorboard=False,
        tensorboard_dir=None,
        use_wandb=False,
        wandb_mode=None,
        wandb_project=None,
        wandb_group=None,
        wandb_exp_name=None,
        wandb_save_dir=None,
        num_steps_per_rollout=1,
    )
    return argparse.Namespace(**{**base, **overrides})


def _write_run(run_dir: Path, steps: int = 12) -> None:
    tracker = Tracker(_args(), run_dir, num_rollout=steps)
    for step in range(steps):
        tracker.log(
            step,
            {
                "rollout/reward_mean": step / steps,
                "train/train_rollout_logprob_abs_diff": 1e-3 / (step + 1),
                "time/train_s": 1.0,
            },
        )
        if step % 4 == 0:
            tracker.log_eval(
                step, {"eval/gsm8k/mean_reward": step / (2 * steps), "eval/gsm8k/num_samples": 8.0}
            )
    tracker.close()


def test_console_line_full_and_partial():
    line = format_train_line(12, 100, TRAIN)
    assert line == (
        "[rollout 12/100] reward 0.53 | resp len 3.1 | logprob diff 2.1e-06 | time 4.2s "
        "(rollout 1.1 / train 2.6 / sync 0.5)"
    )
    line = format_train_line(3, None, {"rollout/reward_mean": 0.25, "time/train_s": 2.0, "other": 1.0})
    assert line == "[rollout 3] reward 0.25 | time 2.0s (train 2.0)"
    assert format_train_line(0, 5, {"rollout/reward_mean": math.nan}) == "[rollout 0/5]"
    # an explicit step time wins over the phase sum (it also covers saving, eval, ...)
    assert format_train_line(1, 5, {"time/step_s": 9.0, "time/train_s": 2.0}).endswith(
        "time 9.0s (train 2.0)"
    )


def test_eval_line():
    metrics = {"eval/gsm8k/mean_reward": 0.612, "eval/gsm8k/num_samples": 64.0, "eval/math/mean_reward": 0.2}
    assert format_eval_line(7, metrics) == "[eval rollout 7] gsm8k reward 0.612 (n=64) | math reward 0.2"


def test_jsonl_records_and_console(tmp_path, capsys):
    tracker = Tracker(_args(), tmp_path / "run", num_rollout=100)
    tracker.log(0, TRAIN)
    tracker.log(1, {"rollout/reward_mean": math.nan, "train/loss": math.inf, "count": 3})
    tracker.log_eval(1, {"eval/gsm8k/mean_reward": 0.5})
    tracker.close()
    tracker.close()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in records] == [0, 1, 1]
    assert {k: records[0][k] for k in TRAIN} == TRAIN
    assert records[1]["rollout/reward_mean"] is None and records[1]["train/loss"] is None
    assert records[1]["count"] == 3.0
    assert all(isinstance(r["time"], float) for r in records)
    out = capsys.readouterr().out.splitlines()
    assert out == [format_train_line(0, 100, TRAIN), "[rollout 1/100]", "[eval rollout 1] gsm8k reward 0.5"]


def test_tensorboard_event_file(tmp_path):
    pytest.importorskip("tensorboard", reason="needs `pip install tensorboard` (vime[tracking])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(_args(use_tensorboard=True), tmp_path)
    tracker.log(0, TRAIN)
    tracker.log(1, {**TRAIN, "rollout/reward_mean": 0.75, "train/loss": math.nan})
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert "train/loss" not in events.Tags()["scalars"]
    scalars = events.Scalars("rollout/reward_mean")
    assert [(s.step, round(s.value, 6)) for s in scalars] == [(0, 0.53), (1, 0.75)]

    custom = tmp_path / "tb_custom"
    tracker = Tracker(_args(use_tensorboard=True, tensorboard_dir=str(custom)), tmp_path / "run2")
    tracker.log(0, TRAIN)
    tracker.close()
    assert list(custom.glob("events.out.tfevents.*"))


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="needs `pip install wandb` (vime[tracking])")
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # any network use would fail
    tracker = Tracker(_args(use_wandb=True, wandb_exp_name="unit", wandb_group="g"), tmp_path / "run")
    assert tracker._wandb_run.settings.mode == "offline"  # no API key -> offline, no network
    tracker.log(0, TRAIN)
    tracker.log(1, {**TRAIN, "rollout/reward_mean": 0.75})
    tracker.close()
    run_dirs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1
    (log,) = run_dirs[0].glob("*.wandb")
    # wandb ships no reader for its record log; history items hold the key and the value as JSON text.
    # The wandb-core service may still be writing it after finish() returns, so wait for the records.
    deadline = time.monotonic() + 10
    while (records := log.read_bytes()).count(b"rollout/reward_mean") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert records.count(b"rollout/reward_mean") >= 2 and b"0.53" in records and b"0.75" in records


def test_missing_optional_package_names_flag(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.split(".")[0] in ("wandb", "tensorboard"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.delitem(sys.modules, "tensorboard", raising=False)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match=r"--use-tensorboard needs the `tensorboard` package.*pip install"):
        Tracker(_args(use_tensorboard=True), tmp_path)
    with pytest.raises(ImportError, match=r"--use-wandb needs the `wandb` package.*pip install wandb"):
        Tracker(_args(use_wandb=True), tmp_path)


def test_plot_png(tmp_path):
    _write_run(tmp_path)
    out = plot_run(tmp_path)
    assert out == tmp_path / "metrics.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (800, 700)


def test_plot_resumed_run_keeps_last_value(tmp_path):
    lines = [{"rollout_id": i, "rollout/reward_mean": i / 10} for i in (0, 1, 2, 1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert _read_series(tmp_path / "metrics.jsonl")["rollout/reward_mean"] == [
        (0, 0.0),
        (1, 0.1),
        (2, 0.2),
        (3, 0.3),
    ]
    assert plot_run(tmp_path, tmp_path / "out.png").stat().st_size > 5_000  # no logprob diff: still plots


def test_plot_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no metrics logged yet"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"rollout_id": 0, "a": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a metrics record"):
        plot_run(tmp_path)


def test_vime_plot_cli(tmp_path):
    _write_run(tmp_path / "run")
    out = tmp_path / "figs" / "run.png"
    cmd = [sys.executable, "-m", "vime.cli", "plot", str(tmp_path / "run"), "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out) and out.stat().st_size > 5_000
    result = subprocess.run(
        cmd[:3] + ["plot", str(tmp_path / "missing")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1 and "vime plot:" in result.stderr and "no metrics file" in result.stderr


def test_tensorboard_project_and_experiment_directories(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="needs `pip install tensorboard` (vime[tracking])")
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    tracker = Tracker(
        _args(use_tensorboard=True, tb_project_name="p", tb_experiment_name="e"), tmp_path / "run"
    )
    tracker.log(0, TRAIN)
    tracker.close()
    assert list((tmp_path / "tb" / "p" / "e").glob("events.out.tfevents.*"))


def test_wandb_naming_flags(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="needs `pip install wandb` (vime[tracking])")
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    args = _args(use_wandb=True, wandb_exp_name="exp", wandb_random_suffix=True, wandb_team="team-x",
                 wandb_run_id="fixedid1", wandb_dir=str(tmp_path / "wb"), wandb_always_use_train_step=True,
                 num_steps_per_rollout=4)  # fmt: skip
    tracker = Tracker(args, tmp_path / "run")
    run = tracker._wandb_run
    assert run.name.startswith("exp_") and len(run.name) == len("exp_") + 8  # slime's random suffix
    assert run.id == "fixedid1" and tracker._step_scale == 4
    tracker.close()
    assert list((tmp_path / "wb" / "wandb").glob("offline-run-*fixedid1"))
