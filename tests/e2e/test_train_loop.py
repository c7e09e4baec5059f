"""``train.py`` and ``train_async.py`` end to end on CPU: Ray, real engines + router, the FSDP2 trainer, weight sync
after each step (checked by the run itself with ``--check-weight-update-equal`` and ``--ci-test``). The runs attach
to the pooled engines (``--rollout-external-engine-addrs``): both of them for the ``distributed`` transport, one
for ``disk``. The ``distributed`` run also has ``--flush-cache-interval 2``: the engines report the version of each
token (vLLM's generate route), which must be the version the run pushed, with the same log-probs, and every other
sync is a full refresh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vime.backends.vllm_utils.control_client import EngineGroup

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 5


# disk: with train_async.py, where rollout k is generated while the trainer learns k-1, --keep-old-actor makes the
# old log-probs those of the weights that generated the rollout (without it they would be one step newer).
CASES = {
    "distributed": ("train.py", ["--log-probs-chunk-size", "3", "--recompute-loss-function", "--use-rollout-entropy",
                                 "--balance-data", "--log-correct-samples", "--flush-cache-interval", "2",
                                 "--save-debug-rollout-data", "ROLLOUTS"]),
    "disk": ("train_async.py", ["--keep-old-actor", "--update-weight-disk-dir", "WEIGHTS", "--update-weight-disk-keep-files",
                                "--custom-update-weight-post-write-path", "rollout_plugins.record_weight_dir"]),
}  # fmt: skip


@pytest.mark.parametrize("transport", list(CASES))
def test_engines_track_the_trainer_after_every_weight_sync(transport, tiny_model_dir, tmp_path, engine_pool):
    script, flags = CASES[transport]
    engines = engine_pool.addrs(2 if transport == "distributed" else 1)
    weight_dir = tmp_path / "weights"
    rollouts = tmp_path / "rollouts" / "{rollout_id}.json"
    argv = [
        sys.executable, str(REPO / script), "--train-backend", "fsdp",
        "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(tiny_model_dir / "train.jsonl"),
        "--rollout-shuffle", "--rm-type", "exact", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "2", "--num-rollout", str(STEPS), "--lr", "5e-3", "--weight-decay", "0",
        "--entropy-coef", "0.1",  # a gradient every step, even when a group's rewards are all equal
        "--update-weight-transport", transport,
        "--log-dir", str(tmp_path / "logs"), "--check-weight-update-equal", "--ci-test",
        "--ci-train-rollout-logprob-abs-diff-threshold", "1e-3", *[{"WEIGHTS": str(weight_dir), "ROLLOUTS": str(rollouts)}.get(f, f) for f in flags],
        "--rollout-external-engine-addrs", *engines,
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(argv, capture_output=True, text=True, timeout=540, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in records] == list(range(STEPS))
    # Every rollout after the first was generated with weights synced from a trainer that had moved
    # (lr 5e-3): the engine's log-probs must equal the trainer's old log-probs (fp32 both sides agree to ~3e-7;
    # weights one optimizer step apart differ by ~1e-4).
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in records]
    assert max(diffs) < 1e-5, diffs
    assert [r["weight_sync/version"] for r in records] == [float(v) for v in range(2, STEPS + 2)]
    assert all(r["weight_sync/bytes"] > 0 for r in records)
    assert all(r["train/grad_norm"] > 0 for r in records)  # the policy moved at every step
    # --check-weight-update-equal: after every sync each engine scored a fixed sequence as the trainer did, within
    # the fp32 bound the run reads from the attached engines' reported dtype (the run fails above it)
    assert all(r["weight_sync/check_abs_diff"] < 1e-5 for r in records)
    # ...after their parameters' checksums matched those recorded when they loaded the version, and each other's
    assert all(r["weight_sync/checksum_s"] > 0 and r["weight_sync/check_s"] > 0 for r in records)
    if transport == "distributed":
        assert all(r["train/rollout_entropy"] > 0 and "correct/num_samples" in r for r in records)
        # --flush-cache-interval 2: rollout r is generated with weight version r + 1, as each token's label says
        for rollout_id in range(STEPS):
            saved = json.loads(Path(str(rollouts).format(rollout_id=rollout_id)).read_text())
            for sample in (s for group in saved["samples"] for s in group):
                assert sample["weight_version_spans"] == [[rollout_id + 1, 0, sample["response_length"]]]
                assert sample["weight_versions"] == [rollout_id + 1]
        assert [r["weight_sync/full_refresh"] for r in records] == [0.0, 1.0, 0.0, 1.0, 0.0]  # versions 2..6
        # the trainer labelled the engines' weights at every sync
        with EngineGroup(engine_pool.urls) as group:
            assert group.run(lambda engine: engine.weight_version()) == [str(STEPS + 1)] * 2
    else:  # every sync's files kept, each announced to the hook once written
        versions = [f"v{v:07d}" for v in range(1, STEPS + 2)]
        assert sorted(p.name for p in weight_dir.iterdir() if p.is_dir()) == versions
        logged = (weight_dir / "post_write.log").read_text().split()
        assert logged[0::3] == versions and set(logged[1::3]) == {"1"}
        assert all(files.endswith(".safetensors") for files in logged[2::3])
