"""slime's CPU optimizer flags on one GPU (issue 23 item 2): with ``--optimizer-cpu-offload
--use-precision-aware-optimizer`` (and ``--overlap-cpu-optimizer-d2h-h2d``) Megatron-Core's hybrid CPU/GPU optimizer
gives the weights the GPU optimizer gives, takes the optimizer state off the GPU, and resumes from a torch_dist
checkpoint bit for bit.

Tolerance: both optimizers run torch's AdamW in fp32 on the same fp32 master weights and the same fp32 gradients
(the first step's loss and gradient norm must be equal bit for bit); only the kernel differs (fused CPU AdamW vs the
CUDA multi-tensor one), so the fp32 masters differ by a few fp32 ulps (~1e-7 relative). The exported weights are
bf16 roundings of those masters: an element changes only where its master lies within that distance of a bf16
rounding midpoint, and then by one bf16 ulp (<= 2^-7 relative). After two steps (the second from weights a few
such ulps apart) the test allows 2 bf16 ulps (rtol 2^-6) on any element and asks 99.9 % of them to be identical.
"""

from __future__ import annotations

import copy
import gc
import importlib.util

import pytest
import torch
from gpu_samples import random_samples

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]

SHAPES = [(3, 2), (5, 7), (1, 4), (8, 1)]  # (prompt, response) tokens of 4 samples: 2 groups of 2
OFFLOAD = ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"]
MODES = {
    "gpu": ["--use-distributed-optimizer"],  # the reference: the same distributed optimizer, state on the GPU
    "offload": OFFLOAD,
    "overlap": [*OFFLOAD, "--overlap-cpu-optimizer-d2h-h2d"],  # slime's Qwen3-30B-A3B recipe
    "half": [*OFFLOAD, "--optimizer-offload-fraction", "0.5"],
}
STATE_BYTES = 12  # per parameter: Adam's fp32 master weight, exp_avg and exp_avg_sq
BF16_ULP = 2.0**-7  # relative


def _args(model_dir, *extra):
    from vime.backends.megatron_utils.hf_config import flags_from_hf_config, flags_to_argv, load_hf_config
    from vime.utils.arguments import parse_args

    return parse_args(
        [
            "--train-backend", "megatron", "--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "4", "--bf16",
            "--lr", "1e-3", "--weight-decay", "0.1", "--adam-beta2", "0.98", "--micro-batch-size", "2",
            *flags_to_argv(flags_from_hf_config(load_hf_config(model_dir))), *extra,
        ]
    )  # fmt: skip


def _weights(trainer):
    return {n: t.cpu() for b in trainer.iter_weight_buckets(1 << 30) for n, t in b}


def _free():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from vime.tools.make_tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("offload")
    shape = dict(num_layers=4, hidden_size=512, intermediate_size=2048)
    return {
        "dense": build_tiny_model(root / "dense", seed=0, task=None, **shape),
        "moe": build_tiny_model(
            root / "moe", seed=0, task=None, **shape, num_experts=4, moe_intermediate_size=512
        ),
    }


def _train(model_dir, mode, steps=2):
    """Two steps in ``mode``: (metrics per step, bf16 weights before and after, GPU bytes the trainer holds after the
    steps, parameter count, where the optimizer's tensors live)."""
    from vime.backends.megatron_utils.trainer import MegatronTrainer
    from vime.utils.offload import optimizer_tensors
    from vime.utils.train_data import shape_rewards

    _free()
    base = torch.cuda.memory_allocated()
    args = _args(model_dir, *MODES[mode])
    samples = random_samples(SHAPES)
    rewards = shape_rewards(args, [samples[:2], samples[2:]])
    trainer = MegatronTrainer(args)
    before = _weights(trainer)
    metrics = [trainer.train(step, samples, rewards) for step in range(steps)]
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    numel = sum(p.numel() for p in trainer.module.parameters())
    # the master weights and moments (not torch's 0-dim step counters, which AdamW keeps on the CPU anyway)
    devices = {t.device.type for t in optimizer_tensors(trainer.optimizer) if t.dim() > 0}
    after = _weights(trainer)
    del trainer
    _free()
    return dict(metrics=metrics, before=before, after=after, held=held, numel=numel, devices=devices)


def _compare(got, want):
    """(largest relative difference in bf16 ulps, share of elements not identical); asserts the tolerance."""
    assert got.keys() == want.keys()
    differing = total = 0
    worst = 0.0
    for name in want:
        a, b = got[name].float(), want[name].float()
        torch.testing.assert_close(a, b, rtol=2 * BF16_ULP, atol=1e-8, msg=name)
        differing += int((a != b).sum())
        total += b.numel()
        worst = max(worst, float(((a - b).abs() / (b.abs() * BF16_ULP).clamp_min(1e-30)).max()))
    assert differing / total < 1e-3, (differing, total)
    return worst, differing / total


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_cpu_optimizer_gives_the_gpu_optimizers_weights_and_frees_its_state(models, kind):
    # warm-up: the one-time CUDA allocations (cuBLAS workspace ...) happen outside the measured runs
    _train(models[kind], "gpu", steps=1)
    runs = {mode: _train(models[kind], mode) for mode in MODES}
    gpu = runs["gpu"]
    update = max(
        float((gpu["after"][n].float() - gpu["before"][n].float()).abs().max()) for n in gpu["after"]
    )
    assert update > 1e-4, update  # the steps moved the weights (lr 1e-3) by far more than the tolerance
    numel, state = gpu["numel"], STATE_BYTES * gpu["numel"]
    lines = [
        f"\n[{kind}] {numel / 1e6:.1f} M parameters, optimizer state {state / 2**20:.0f} MiB; GPU bytes held:"
    ]
    for mode, run in runs.items():
        # the first step starts from the same weights: its loss and gradients do not see the optimizer (the
        # precision-aware path reads the same fp32 gradient buffer, as decoupled gradients)
        assert run["metrics"][0]["loss"] == gpu["metrics"][0]["loss"], mode
        first, want = run["metrics"][0]["grad_norm"], gpu["metrics"][0]["grad_norm"]
        assert abs(first - want) <= 1e-6 * want, (mode, first, want)
        # the second step's gradients come from weights a few bf16 ulps apart (GRPO's loss is ~0 on-policy)
        second, want = run["metrics"][1]["grad_norm"], gpu["metrics"][1]["grad_norm"]
        assert abs(second - want) <= 1e-2 * want, (mode, second, want)
        worst, share = _compare(run["after"], gpu["after"])
        lines.append(
            f"  {mode}: {run['held'] / 2**20:.0f} MiB ({(gpu['held'] - run['held']) / state:.3f} of the state "
            f"freed), optimizer tensors on {sorted(run['devices'])}; vs gpu: {share:.2e} of the weights differ, "
            f"worst {worst:.2f} bf16 ulp"
        )
    print("\n".join(lines))
    assert gpu["devices"] == {"cuda"}
    assert runs["offload"]["devices"] == runs["overlap"]["devices"] == {"cpu"}
    assert runs["half"]["devices"] == {"cpu", "cuda"}
    for mode in ("offload", "overlap"):  # all of Adam's state (master weights and moments) left the GPU
        freed = gpu["held"] - runs[mode]["held"]
        assert abs(freed - state) <= 0.05 * state, (mode, freed, state)
    assert runs["offload"]["held"] < runs["half"]["held"] < gpu["held"]
    # the overlapped copies and per-parameter CPU optimizers compute the same numbers as one CPU optimizer
    over, plain = runs["overlap"]["after"], runs["offload"]["after"]
    assert all(torch.equal(over[n], plain[n]) for n in plain), [
        n for n in plain if not torch.equal(over[n], plain[n])
    ]


def test_cpu_optimizer_resumes_from_a_torch_dist_checkpoint_bit_for_bit(models, tmp_path):
    """slime's recipe (offload + overlap): save after a step, load into a new trainer, and the next step gives the
    same loss and the same weights as the trainer that kept going (the CPU master weights, moments and step count
    went through the checkpoint)."""
    from vime.backends.megatron_utils.trainer import MegatronTrainer
    from vime.utils.train_data import shape_rewards

    save = str(tmp_path / "ckpt")
    args = _args(models["moe"], *MODES["overlap"], "--save", save)
    samples = random_samples(SHAPES)
    rewards = shape_rewards(args, [samples[:2], samples[2:]])
    trainer = MegatronTrainer(args)
    trainer.train(0, samples, rewards)
    trainer.save(3, save)
    saved = _weights(trainer)
    keeps_going = trainer.train(1, samples, rewards)
    want = _weights(trainer)
    del trainer
    _free()

    resumed_args = copy.deepcopy(args)
    resumed_args.load = save
    resumed = MegatronTrainer(resumed_args)
    assert resumed.load() == 3 and resumed.step == 1
    loaded = _weights(resumed)
    assert all(torch.equal(loaded[n], saved[n]) for n in saved)
    again = resumed.train(1, samples, rewards)
    got = _weights(resumed)
    assert abs(again["loss"] - keeps_going["loss"]) < 1e-6 and again["grad_norm"] == keeps_going["grad_norm"]
    assert all(torch.equal(got[n], want[n]) for n in want), [
        n for n in want if not torch.equal(got[n], want[n])
    ]
    changed = max(float((want[n].float() - saved[n].float()).abs().max()) for n in want)
    assert changed > 0  # the resumed step did move the weights
    print(
        f"\n[offload + overlap] torch_dist save -> load -> next step bit-identical (largest update {changed:.2e})"
    )
