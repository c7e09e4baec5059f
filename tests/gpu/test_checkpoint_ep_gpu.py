"""Issue 23 item 2 at the seed's shape with EP over every GPU of the machine (4, or 2 where only 2 are lent): the
Qwen3-30B-A3B-shaped MoE (2 of its layers, 128 experts top-8, Qwen3's 151,936-token vocabulary, bf16), Megatron
with the distributed optimizer.

- ``convert``: HF -> ``torch_dist`` -> HF with vime's conversion tools (``tools/convert_*.py``), each rank holding
  its share of the experts, gives back every tensor bit for bit;
- ``save`` then ``resume``: after two GRPO steps a ``torch_dist`` save, then a ``--load`` in fresh processes, gives
  the same weights, Adam step counts and LR schedule, and the next step the same loss, gradient norm and weights as
  the run that saved.

Bit for bit across processes needs a forward and backward whose numbers depend on their inputs only. GRPO's
on-policy loss is ~0 (the advantages of a group sum to 0 and the ratio is 1 up to rounding): the loss compared is
the rounding difference between the log-prob pass and the training pass, so any run-to-run difference in the
kernels flips its sign (the first GPU run: 5.2e-4 saved vs -4.8e-4 resumed, at bit-identical weights). Two such
differences were in the path: Megatron-Core's MoE ``unpermute`` sums each token's top-8 expert outputs with an
atomic ``scatter_add_`` (order-dependent bf16 sums) unless torch's deterministic algorithms are on (then
``index_add_``), and its torch.compile'd weighted SwiGLU, called once per expert with that expert's token count,
hits dynamo's recompile limit (8; the resumed run's log shows it on both ranks) and then runs shapes it has not
compiled eagerly, rounding twice where the compiled kernel rounds once: which shapes depends on what the process ran
before. So the workers run with
``torch.use_deterministic_algorithms(True)`` (FlashAttention's backward, ``index_add_``; cuBLAS with
``CUBLAS_WORKSPACE_CONFIG``) and ``--no-bias-swiglu-fusion``. The resume phase prints every number first (one
``RESUME {json}`` line) and then asserts in the order that tells the causes apart: the weights, Adam step counts,
learning rates and scheduler step after the load; the precondition (the log-probs at the saved weights are the same
twice in the saving process, and again in the resumed one); the next step's loss and gradient norm; the weights
after it.

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
SAVED_STEP = 3  # the rollout id the checkpoint is saved under
# two, so that a restored Adam step count differs from the one a fresh optimizer's dummy step gives (1)
STEPS_BEFORE_SAVE = 2
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
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # deterministic cuBLAS (read when its handle is made)
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

    # --no-bias-swiglu-fusion: the compiled SwiGLU's numbers depend on the process's history (module docstring);
    # a decaying LR, so that the next step's LR depends on the restored scheduler step
    config = make_args(
        model_dir, "--bf16", "--use-distributed-optimizer", "--expert-model-parallel-size", str(GPUS),
        "--moe-token-dispatcher-type", "alltoall", "--lr", "1e-4", "--lr-decay-style", "linear",
        "--lr-decay-iters", "8", "--min-lr", "1e-5", "--no-bias-swiglu-fusion", "--save", str(root / "ckpt"),
        *extra,
    )  # fmt: skip
    return config, MegatronTrainer(config)


def _samples_and_rewards(config):
    from test_megatron_gpu import samples_for_test

    from vime.utils.train_data import shape_rewards

    samples = samples_for_test(vocab=151936)
    return samples, shape_rewards(config, [samples[i : i + 2] for i in range(0, 6, 2)])


def _step(trainer, config, step: int) -> dict[str, float]:
    samples, rewards = _samples_and_rewards(config)
    return {k: float(v) for k, v in trainer.train(step, samples, rewards).items()}


def _log_probs(trainer, config) -> list[list[float]]:
    """The policy's log-probs of the test samples' response tokens (collective; every rank's answer)."""
    samples, _ = _samples_and_rewards(config)
    return [t.tolist() for t in trainer.compute_log_probs(samples)]


def _optimizer_state(trainer) -> dict:
    """What the next update reads besides the weights and gradients: every Adam state's step count, the param
    groups' learning rates and the LR scheduler's step."""
    from vime.utils.offload import torch_optimizers

    steps, lrs = set(), set()
    for inner in torch_optimizers(trainer.optimizer):
        lrs.update(float(group["lr"]) for group in inner.param_groups)
        for state in inner.state.values():
            if "step" in state:
                steps.add(float(state["step"]))
    return {
        "adam_steps": sorted(steps), "lrs": sorted(lrs), "scheduler_steps": trainer.scheduler.num_steps,
        "trainer_step": trainer.step,
    }  # fmt: skip


def _largest_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def _deterministic() -> None:
    """Kernels whose numbers do not depend on thread timing (module docstring); an op that has none raises, naming
    itself. Uninitialised memory is left as it is (filling it is a separate check)."""
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False


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
        _deterministic()
        config, trainer = _trainer(model_dir, root)
        for rollout in range(STEPS_BEFORE_SAVE):
            _step(trainer, config, rollout)
        trainer.save(SAVED_STEP, str(root / "ckpt"))
        saved = _checksums(trainer)
        state = _optimizer_state(trainer)
        log_probs, again = _log_probs(trainer, config), _log_probs(trainer, config)
        metrics_next = _step(trainer, config, STEPS_BEFORE_SAVE)
        after_next = _checksums(trainer)
        if rank == 0:
            report = {
                "log_probs_twice_in_the_saving_process": _largest_difference(log_probs, again),
                "state": state, "next": metrics_next,
            }  # fmt: skip
            print("SAVED " + json.dumps(report), flush=True)
            record.write_text(
                json.dumps(
                    {"saved": saved, "state": state, "log_probs": log_probs, "next": metrics_next,
                     "after_next": after_next, "log_probs_again": again}
                )
            )  # fmt: skip
    elif phase == "resume":
        _deterministic()
        config, trainer = _trainer(model_dir, root, "--load", str(root / "ckpt"))
        assert trainer.load() == SAVED_STEP
        loaded = _checksums(trainer)
        state = _optimizer_state(trainer)
        log_probs = _log_probs(trainer, config)
        metrics_next = _step(trainer, config, STEPS_BEFORE_SAVE)
        after_next = _checksums(trainer)
        if rank == 0:
            want = json.loads(record.read_text())
            weights = [n for n in want["saved"] if loaded.get(n) != want["saved"][n]]
            after = [n for n in want["after_next"] if after_next.get(n) != want["after_next"][n]]
            report = {
                "weights_loaded_differ": len(weights),
                "state": {"resumed": state, "saved": want["state"]},
                "log_probs_twice_in_the_saving_process": _largest_difference(want["log_probs"], want["log_probs_again"]),
                "log_probs_saving_vs_resumed_process": _largest_difference(want["log_probs"], log_probs),
                "next": {"resumed": metrics_next, "kept_going": want["next"]},
                "weights_after_next_differ": len(after),
            }  # fmt: skip
            print("RESUME " + json.dumps(report), flush=True)
            # in the order that tells the causes apart: state not restored, then kernels not reproducible (no
            # bitwise comparison can hold), then a next step that differs for another reason
            assert not weights, f"{len(weights)} tensors differ after the load, e.g. {weights[:5]}"
            assert state == want["state"], ("optimizer/scheduler state after the load", state, want["state"])
            assert report["log_probs_twice_in_the_saving_process"] == 0, (
                "the forward is not deterministic within one process (a kernel without a deterministic version?)",
                report,
            )
            assert report["log_probs_saving_vs_resumed_process"] == 0, (
                "the forward differs between the saving and the resumed process at bit-identical weights: its "
                "numbers depend on the process's history (a compiled kernel, autotuning)",
                report,
            )
            assert metrics_next["loss"] == want["next"]["loss"], ("next-step loss", report)
            assert metrics_next["grad_norm"] == want["next"]["grad_norm"], ("next-step gradient norm", report)
            assert not after, f"{len(after)} tensors differ after the next step, e.g. {after[:5]}; {report}"
            print(
                f"RESUME OK ep={GPUS}: {len(loaded)} tensors, Adam steps {state['adam_steps']}, next-step loss "
                f"{metrics_next['loss']:.6g} and grad norm {metrics_next['grad_norm']:.6g} both times",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
