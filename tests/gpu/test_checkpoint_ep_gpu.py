"""Issue 23 item 2 at the seed's shape with EP over every GPU of the machine (4, or 2 where only 2 are lent): the
Qwen3-30B-A3B-shaped MoE (2 of its layers, 128 experts top-8, Qwen3's 151,936-token vocabulary, bf16), Megatron
with the distributed optimizer.

- ``convert``: HF -> ``torch_dist`` -> HF with vime's conversion tools (``tools/convert_*.py``), each rank holding
  its share of the experts, gives back every tensor bit for bit;
- ``save`` then ``resume``: after one GRPO step a ``torch_dist`` save, then a ``--load`` in fresh processes, gives
  the same weights, and the next step the same loss and the same weights as the run that saved.

The pytest test launches this file under ``torchrun`` once per phase (a fresh set of processes each: what a user's
``--load`` is); the ``__main__`` part is the per-rank worker. Run with the kit (tests/gpu/README.md):
``bash tests/gpu/run.sh tests/gpu/test_checkpoint_ep_gpu.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
GPUS = min(4, torch.cuda.device_count()) if torch.cuda.is_available() else 0
SHAPE = "30b-a3b-2l"
SAVED_STEP = 3
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason="needs 2 or 4 CUDA GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]


def _launch(phase: str, root: Path, model_dir: Path) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), str(REPO), os.environ.get("PYTHONPATH", "")]
        ),
    }
    cmd = [
        "torchrun",
        "--nproc-per-node",
        str(GPUS),
        "--master-port",
        "29531",
        __file__,
        phase,
        str(root),
        str(model_dir),
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    print(result.stdout[-3000:])
    assert result.returncode == 0, f"{phase} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result.stdout


def test_ep_checkpoint_and_conversion_at_the_30b_a3b_shape(tmp_path):
    sys.path.insert(0, str(REPO))
    from bench.shapes import build_shape

    model_dir = build_shape(SHAPE)
    assert f"CONVERT OK ep={GPUS}" in _launch("convert", tmp_path, model_dir)
    _launch("save", tmp_path, model_dir)
    assert f"RESUME OK ep={GPUS}" in _launch("resume", tmp_path, model_dir)


def _checksums(trainer) -> dict[str, int]:
    """Every HF-named weight's bytes summed as int16 words (exact; collective over the ranks, rank 0's answer)."""
    return {
        name: int(tensor.contiguous().view(torch.int16).sum(dtype=torch.int64))
        for bucket in trainer.iter_weight_buckets(1 << 30)
        for name, tensor in bucket
    }


def _trainer(model_dir: Path, root: Path, *extra: str):
    from test_megatron_gpu import make_args

    from vime.backends.megatron_utils.trainer import MegatronTrainer

    config = make_args(
        model_dir, "--bf16", "--use-distributed-optimizer", "--expert-model-parallel-size", str(GPUS),
        "--moe-token-dispatcher-type", "alltoall", "--lr", "1e-4", "--save", str(root / "ckpt"), *extra,
    )  # fmt: skip
    return config, MegatronTrainer(config)


def _step(trainer, config, step: int) -> float:
    from test_megatron_gpu import samples_for_test

    from vime.utils.train_data import shape_rewards

    samples = samples_for_test(vocab=151936)
    rewards = shape_rewards(config, [samples[i : i + 2] for i in range(0, 6, 2)])
    return float(trainer.train(step, samples, rewards)["loss"])


def _worker(phase: str, root: Path, model_dir: Path) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from vime.backends.megatron_utils.convert import hf_to_torch_dist, torch_dist_to_hf

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    ep = ["--expert-model-parallel-size", str(GPUS)]
    record = root / "saved.json"
    if phase == "convert":
        hf_to_torch_dist(["--hf-checkpoint", str(model_dir), "--save", str(root / "dist"), *ep])
        dist.barrier()
        out = root / "hf"
        torch_dist_to_hf(
            ["--hf-checkpoint", str(model_dir), "--load", str(root / "dist"), "--output-dir", str(out),
             "--dtype", "bfloat16", *ep]
        )  # fmt: skip
        dist.barrier()
        if rank == 0:
            original = {n: t for f in model_dir.glob("*.safetensors") for n, t in load_file(f).items()}
            again = {n: t for f in out.glob("*.safetensors") for n, t in load_file(f).items()}
            assert sorted(again) == sorted(original), sorted(set(again) ^ set(original))[:10]
            differ = [n for n, t in original.items() if not torch.equal(again[n], t)]
            assert not differ, f"{len(differ)} tensors differ after HF -> torch_dist -> HF, e.g. {differ[:5]}"
            print(f"CONVERT OK ep={GPUS}: {len(original)} tensors bit-exact", flush=True)
    elif phase == "save":
        config, trainer = _trainer(model_dir, root)
        _step(trainer, config, 0)
        trainer.save(SAVED_STEP, str(root / "ckpt"))
        saved = _checksums(trainer)
        loss_next = _step(trainer, config, 1)
        if rank == 0:
            record.write_text(
                json.dumps({"saved": saved, "loss_next": loss_next, "after_next": _checksums(trainer)})
            )
        else:
            _checksums(trainer)  # collective
    elif phase == "resume":
        config, trainer = _trainer(model_dir, root, "--load", str(root / "ckpt"))
        assert trainer.load() == SAVED_STEP
        loaded = _checksums(trainer)
        loss_next = _step(trainer, config, 1)
        after_next = _checksums(trainer)
        if rank == 0:
            want = json.loads(record.read_text())
            assert loaded == want["saved"], [n for n in want["saved"] if loaded.get(n) != want["saved"][n]][
                :5
            ]
            assert abs(loss_next - want["loss_next"]) < 1e-6, (loss_next, want["loss_next"])
            differ = [n for n in want["after_next"] if after_next.get(n) != want["after_next"][n]]
            assert not differ, f"{len(differ)} tensors differ after the next step, e.g. {differ[:5]}"
            print(
                f"RESUME OK ep={GPUS}: {len(loaded)} tensors, next-step loss {loss_next:.6g} both times",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
