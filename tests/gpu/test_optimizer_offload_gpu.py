"""slime's CPU optimizer flags on one GPU (issue 23 item 2): with ``--optimizer-cpu-offload
--use-precision-aware-optimizer`` (and ``--overlap-cpu-optimizer-d2h-h2d``) Megatron-Core's hybrid CPU/GPU optimizer
gives the weights the GPU optimizer gives, takes the optimizer state off the GPU, and resumes from a torch_dist
checkpoint bit for bit.

Tolerance, from what differs (Megatron-Core 0.19.2 without Apex/TE: both sides are torch's AdamW, decoupled weight
decay, on fp32 master weights made from the same bf16 weights; the clipped fp32 gradients are the same buffer, read
as ``.grad`` or as the precision-aware ``.decoupled_grad``):

- after the first step only the AdamW kernel differs (fused CPU vs CUDA multi-tensor): the fp32 masters differ by a
  few fp32 roundings of the weight and of the lr-sized update, and their bf16 roundings differ only where a master
  lies that close to a bf16 rounding midpoint: by one bf16 ulp, in a share of about 2^-16 of the elements. Bound: every
  element within 1 ulp (of the larger of the two) + 2^-20 (lr + |w|) (the fp32 part, which only shows where w is
  near 0), and under 1e-3 of the elements not identical.
- the second step checks what step 1 carried over (the masters, both moments, the step count), so it must not see
  step 1's one-ulp differences through the forward: left alone, they flip bf16 roundings of activations (and, in the
  MoE, a token's expert), and Adam turns the gradients of elements at that noise level into a different fraction
  of lr (seen on an H200: 1.2 % of a dense model's elements more than one ulp apart after step 2, from a correct
  optimizer). So before step 2 every CPU-optimizer run takes the GPU run's bf16 model weights after step 1 (not its
  fp32 masters): the forward, backward and gradients are then the GPU run's exactly (the gradient norm is checked),
  only the optimizer state differs, and step 1's bounds apply again. A wiring error (lr, betas, eps, bias
  correction, weight decay, a stale or lost copy of a state) moves most updated elements, not a share under 1e-3.

Each failure prints the worst element (got, want, the weight before, bf16 ulps, lr units) and the shares.
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


def _model_weights(trainer) -> dict[str, torch.Tensor]:
    """The bf16 weights the forward reads, by Megatron's names (a copy on the CPU)."""
    return {n: p.detach().cpu().clone() for n, p in trainer.module.named_parameters()}


def _set_model_weights(trainer, weights: dict[str, torch.Tensor]) -> None:
    """Overwrite the bf16 weights the forward reads (not the optimizer's fp32 masters)."""
    params = dict(trainer.module.named_parameters())
    assert params.keys() == weights.keys()
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(weights[name])


def _adam_steps(trainer) -> list[float]:
    """The distinct step counts of the Adam states (the CPU optimizers' included)."""
    from vime.utils.offload import torch_optimizers

    return sorted(
        {
            float(state["step"])
            for inner in torch_optimizers(trainer.optimizer)
            for state in inner.state.values()
        }
    )


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


def _train(model_dir, mode, steps=2, second_step_from=None):
    """Two steps in ``mode``: metrics per step, bf16 weights before and after each step (``after``: the last), GPU
    bytes the trainer holds after the steps, parameter count, where the optimizer's tensors live, the lr, and
    the model's weights after the first step (``model_after_first``). ``second_step_from``: another run's
    ``model_after_first``, written into the model before the second step (module docstring)."""
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
    metrics, after_steps, model_after_first = [], [], None
    for step in range(steps):
        if step == 1 and second_step_from is not None:
            _set_model_weights(trainer, second_step_from)
        metrics.append(trainer.train(step, samples, rewards))
        after_steps.append(_weights(trainer))
        if step == 0:
            model_after_first = _model_weights(trainer)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    numel = sum(p.numel() for p in trainer.module.parameters())
    # the master weights and moments (not torch's 0-dim step counters, which AdamW keeps on the CPU anyway)
    devices = {t.device.type for t in optimizer_tensors(trainer.optimizer) if t.dim() > 0}
    del trainer
    _free()
    return dict(
        metrics=metrics, before=before, after_steps=after_steps, after=after_steps[-1], held=held, numel=numel,
        devices=devices, lr=args.lr, model_after_first=model_after_first,
    )  # fmt: skip


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at ``|x|`` (8 significant bits: 2^(e-8) for |x| in [2^(e-1), 2^e))."""
    _, exponent = torch.frexp(x.abs().float())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8)


def _compare(got, want, before, step: int, lr: float, label: str):
    """Weights after optimizer step ``step`` (1 or 2) in a CPU-optimizer mode vs the GPU optimizer's: the bounds of
    the module docstring. Returns (worst difference in bf16 ulps, share not identical, share more than 1 ulp
    apart); on failure the message names the worst element."""
    assert got.keys() == want.keys()
    total = differing = beyond_ulp = 0
    worst = dict(excess=-float("inf"))
    for name in want:
        a, b = got[name].float(), want[name].float()
        diff = (a - b).abs()
        ulp = bf16_ulp(torch.maximum(a.abs(), b.abs()))
        bound = ulp + 2.0**-20 * (lr + torch.maximum(a.abs(), b.abs()))
        total += b.numel()
        differing += int((diff > 0).sum())
        beyond_ulp += int((diff > ulp).sum())
        excess = diff / bound
        i = int(excess.argmax())
        if float(excess.view(-1)[i]) > worst["excess"]:
            worst = dict(
                excess=float(excess.view(-1)[i]), name=name,
                index=[int(j) for j in torch.unravel_index(torch.tensor(i), b.shape)],
                got=float(a.view(-1)[i]), want=float(b.view(-1)[i]), before=float(before[name].float().view(-1)[i]),
                ulps=float((diff / ulp).view(-1)[i]), lrs=float(diff.view(-1)[i]) / lr,
            )  # fmt: skip
    shares = differing / total, beyond_ulp / total
    detail = (
        f"{label}, after step {step}: worst {worst['name']}{worst['index']} = {worst['got']!r}, GPU optimizer "
        f"{worst['want']!r} (before the steps {worst['before']!r}): {worst['ulps']:.1f} bf16 ulps, "
        f"{worst['lrs']:.3g} lr, {worst['excess']:.3g} x its bound; {shares[0]:.2e} of {total} elements not identical, "
        f"{shares[1]:.2e} more than 1 ulp apart"
    )
    print(detail)
    assert worst["excess"] <= 1.0, detail
    assert shares[0] < 1e-3, detail
    return worst["ulps"], shares[0], shares[1]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_cpu_optimizer_gives_the_gpu_optimizers_weights_and_frees_its_state(models, kind):
    # warm-up: the one-time CUDA allocations (cuBLAS workspace ...) happen outside the measured runs
    _train(models[kind], "gpu", steps=1)
    gpu = _train(models[kind], "gpu")
    runs = {"gpu": gpu} | {
        mode: _train(models[kind], mode, second_step_from=gpu["model_after_first"])
        for mode in MODES
        if mode != "gpu"
    }
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
        # the second step starts from the GPU run's model weights: the same gradients again
        assert run["metrics"][1]["loss"] == gpu["metrics"][1]["loss"], mode
        second, want = run["metrics"][1]["grad_norm"], gpu["metrics"][1]["grad_norm"]
        assert abs(second - want) <= 1e-6 * want, (mode, second, want)
        compared = [
            _compare(after, want, gpu["before"], step, gpu["lr"], f"[{kind}] {mode}")
            for step, (after, want) in enumerate(zip(run["after_steps"], gpu["after_steps"], strict=True), 1)
        ]
        (_, first_share, _), (worst, share, beyond) = compared
        lines.append(
            f"  {mode}: {run['held'] / 2**20:.0f} MiB ({(gpu['held'] - run['held']) / state:.3f} of the state "
            f"freed), optimizer tensors on {sorted(run['devices'])}; vs gpu: {first_share:.2e} of the weights differ "
            f"after step 1, {share:.2e} after step 2 ({beyond:.2e} by more than 1 ulp, worst {worst:.2f} bf16 ulp)"
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
    """slime's recipe (offload + overlap): save after two steps, load into a new trainer, and the next step gives the
    same loss and the same weights as the trainer that kept going (the CPU master weights, moments and Adam's step
    count went through the checkpoint: after one step a lost count would not show, the fresh optimizer's is 1 too)."""
    from vime.backends.megatron_utils.trainer import MegatronTrainer
    from vime.utils.train_data import shape_rewards

    save = str(tmp_path / "ckpt")
    args = _args(models["moe"], *MODES["overlap"], "--save", save)
    samples = random_samples(SHAPES)
    rewards = shape_rewards(args, [samples[:2], samples[2:]])
    trainer = MegatronTrainer(args)
    for step in range(2):
        trainer.train(step, samples, rewards)
    trainer.save(3, save)
    saved, saved_steps = _weights(trainer), _adam_steps(trainer)
    keeps_going = trainer.train(2, samples, rewards)
    want = _weights(trainer)
    del trainer
    _free()

    resumed_args = copy.deepcopy(args)
    resumed_args.load = save
    resumed = MegatronTrainer(resumed_args)
    assert resumed.load() == 3 and resumed.step == 2
    assert saved_steps == [2.0] and _adam_steps(resumed) == saved_steps, (_adam_steps(resumed), saved_steps)
    loaded = _weights(resumed)
    assert all(torch.equal(loaded[n], saved[n]) for n in saved)
    again = resumed.train(2, samples, rewards)
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
