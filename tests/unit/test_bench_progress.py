"""Benchmarks through ``train.py`` report as they go: start-up phases and each step as ``[bench]`` lines, and the
steps so far after each one (``bench/grpo_step.py``); ``bench/seed_headline.py``'s engines skip vLLM's
AllReduce+RMSNorm fusion unless asked."""

from __future__ import annotations

import json
import sys

from bench import grpo_step, seed_headline
from bench.grpo_step import progress_line, run_steps
from bench.seed_headline import parse_options, slime_argv

FUSION_OFF = ["--vllm-compilation-config", '{"pass_config": {"fuse_allreduce_rms": false}}']


def test_start_phases_and_step_lines_are_reported_other_lines_are_not():
    assert progress_line("[vime] Ray up 4 s after start\n", 4.2) == "[bench] Ray up 4 s after start"
    assert progress_line("[vime] engines and router up 251 s after start\n", 251.0) == (
        "[bench] engines and router up 251 s after start"
    )
    step = "[rollout 0/2] reward 0.5 | time 80.1s (rollout 60.0 / train 20.0 / sync 0.1)"
    assert progress_line(step + "\n", 331.6) == f"[bench] 332 s: {step}"
    assert progress_line("[rollout 3]\n", 10) == "[bench] 10 s: [rollout 3]"
    for other in (
        "(RolloutManagerActor pid=12) [vime] engines and router up 3 s after start",
        "[vime] engine 0 (policy): http://10.0.0.1:8000 on node ab (10.0.0.1), server pid 3 (owned by actor pid 2)",
        "[rollout 0/2]x",
        "[eval rollout 2] gsm8k reward 0.61 (n=64)",
    ):
        assert progress_line(other, 1.0) is None, other


def test_each_step_is_handed_over_as_it_is_logged(tmp_path, monkeypatch, capsys):
    """A stand-in for ``train.py`` logs two steps, the second only once ``on_step`` has seen the first."""
    monkeypatch.setattr(grpo_step, "gpu_memory_peak", lambda stop, peak: stop.wait())  # no nvidia-smi here
    script = """
import json, pathlib, time
logs = pathlib.Path("logs"); logs.mkdir()
print("[vime] Ray up 1 s after start", flush=True)
with open(logs / "metrics.jsonl", "a") as f:
    for i in range(2):
        while i and not pathlib.Path("seen-0").exists():
            time.sleep(0.01)
        f.write(json.dumps({"rollout_id": i, "time/rollout_s": 1.0 + i, "time/train_s": 2.0, "time/sync_s": 0.5}) + "\\n")
        f.flush()
        print(f"[rollout {i}/2] time {3.5 + i:.1f}s", flush=True)
"""
    seen = []

    def on_step(figures, steps, peak_gib, wall_s):
        seen.append(([r["rollout_id"] for r in steps], figures["time/rollout_s"]))
        (tmp_path / f"seen-{len(seen) - 1}").touch()

    figures, steps, _, _ = run_steps([sys.executable, "-c", script], tmp_path, on_step=on_step)
    assert seen == [([0], 1.0), ([1], 2.0)]  # the first step alone, then the steps after it
    assert [r["rollout_id"] for r in steps] == [1] and figures["time/rollout_s"] == 2.0
    out = capsys.readouterr().out
    assert "[bench] Ray up 1 s after start" in out and "s: [rollout 1/2] time 4.5s" in out


def test_the_headline_engines_skip_the_allreduce_rms_fusion_unless_asked(tmp_path, monkeypatch):
    monkeypatch.setattr(seed_headline, "trainer_flags", lambda backend, model_dir: [])  # no model here
    argv = slime_argv(parse_options(["--gpus", "4", "--", "--vllm-seed", "1"]), tmp_path, tmp_path)
    at = argv.index(FUSION_OFF[0])
    assert argv[at : at + 2] == FUSION_OFF and json.loads(argv[at + 1]) == {
        "pass_config": {"fuse_allreduce_rms": False}
    }
    assert argv[-2:] == ["--vllm-seed", "1"]  # train.py flags given after -- come last, so they win
    assert FUSION_OFF[0] not in slime_argv(parse_options(["--allreduce-rms-fusion"]), tmp_path, tmp_path)


def test_the_headline_runs_one_engine_over_all_gpus_unless_told_how_many_each(tmp_path, monkeypatch):
    monkeypatch.setattr(seed_headline, "trainer_flags", lambda backend, model_dir: [])  # no model here

    def per_engine(*flags: str) -> str:
        argv = slime_argv(parse_options(["--gpus", "4", *flags]), tmp_path, tmp_path)
        return argv[argv.index("--rollout-num-gpus-per-engine") + 1]

    assert per_engine() == "4"
    assert per_engine("--gpus-per-engine", "1") == "1"
