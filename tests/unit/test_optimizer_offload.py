"""slime's CPU optimizer flags (issue 23 item 2): the Megatron backend maps ``--optimizer-cpu-offload``,
``--overlap-cpu-optimizer-d2h-h2d``, ``--use-precision-aware-optimizer`` and ``--optimizer-offload-fraction`` to
Megatron-Core's ``OptimizerConfig`` (its hybrid CPU/GPU optimizer), refuses the combinations Megatron-Core cannot run
without TransformerEngine or runs wrongly, and the fsdp backend refuses them all. The hybrid optimizer's CPU and GPU
halves are what the offloader and the memory plan see."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
from test_backend_flags import parse, refusal  # the same parse-and-validate helpers

from vime.backends.megatron_utils.config import ddp_config_kwargs, optimizer_config_kwargs
from vime.utils.memory_plan import unallocated_optimizer_state_bytes
from vime.utils.offload import optimizer_tensors, torch_optimizers

# slime's OPTIMIZER_ARGS of run-qwen3-30B-A3B(-multi-agent).sh, as written there; slime always trains in bf16
SLIME_30B = (
    "--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 "
    "--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer"
).split()
OFFLOAD = ["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--bf16"]
LOGGER = "vime.utils.backend_flags"


def test_slimes_30b_optimizer_flags_reach_megatron_cores_optimizer_config(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        args = parse("megatron", *SLIME_30B, "--bf16")
    kwargs = optimizer_config_kwargs(args, lr=1e-6)
    assert {k: kwargs[k] for k in kwargs if "offload" in k or "precision" in k or "cpu" in k} == {
        "optimizer_cpu_offload": True,
        "optimizer_offload_fraction": 1.0,  # Megatron-LM's default: all of it (Megatron-Core's own is 0.0)
        "overlap_cpu_optimizer_d2h_h2d": True,
        "use_precision_aware_optimizer": True,
    }
    adam = ("optimizer", "lr", "weight_decay", "adam_beta2")
    assert [kwargs[k] for k in adam] == ["adam", 1e-6, 0.1, 0.98]
    assert kwargs["bf16"] and kwargs["params_dtype"] is torch.bfloat16
    # Megatron-Core asserts the distributed optimizer with the precision-aware one; slime always has it on
    assert kwargs["use_distributed_optimizer"] and ddp_config_kwargs(args)["use_distributed_optimizer"]
    assert "--use-precision-aware-optimizer: turns on --use-distributed-optimizer" in caplog.text


def test_without_the_flags_the_optimizer_stays_on_the_gpu(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        args = parse("megatron", "--bf16")
    kwargs = optimizer_config_kwargs(args, lr=1e-3)
    assert not kwargs["optimizer_cpu_offload"] and not kwargs["overlap_cpu_optimizer_d2h_h2d"]
    assert not kwargs["use_precision_aware_optimizer"] and not kwargs["use_distributed_optimizer"]
    assert kwargs["lr"] == 1e-3
    assert not caplog.text
    quiet = parse("megatron", *OFFLOAD, "--use-distributed-optimizer")
    assert optimizer_config_kwargs(quiet, lr=1e-3)["optimizer_cpu_offload"]


def test_an_offload_fraction_is_passed_on():
    args = parse("megatron", *OFFLOAD, "--optimizer-offload-fraction", "0.25")
    assert optimizer_config_kwargs(args, lr=1e-3)["optimizer_offload_fraction"] == 0.25
    nothing_offloaded = parse("megatron", *OFFLOAD, "--optimizer-offload-fraction", "0")
    assert optimizer_config_kwargs(nothing_offloaded, lr=1e-3)["optimizer_offload_fraction"] == 0.0


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--use-precision-aware-optimizer", "--bf16", "--use-distributed-optimizer"],
            "--use-precision-aware-optimizer without --optimizer-cpu-offload: on the GPU, Megatron-Core's "
            "precision-aware optimizer is TransformerEngine's FusedAdam",
        ),
        (
            ["--optimizer-cpu-offload", "--bf16"],
            "--optimizer-cpu-offload needs --use-precision-aware-optimizer (Megatron-LM",
        ),
        (
            ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"],
            "--optimizer-cpu-offload needs --bf16 (Megatron-Core 0.19's hybrid optimizer keeps fp32 master copies "
            "of bf16 weights only",
        ),
        (["--optimizer-cpu-offload"], "needs --use-precision-aware-optimizer (Megatron-LM"),
        (
            ["--overlap-cpu-optimizer-d2h-h2d", "--bf16"],
            "--overlap-cpu-optimizer-d2h-h2d without --optimizer-cpu-offload: these tune the CPU optimizer",
        ),
        (
            ["--optimizer-offload-fraction", "0.5"],
            "--optimizer-offload-fraction 0.5 without --optimizer-cpu-offload",
        ),
        (
            [*OFFLOAD, "--optimizer-offload-fraction", "1.5"],
            "--optimizer-offload-fraction 1.5: the share of the",
        ),
        ([*OFFLOAD, "--optimizer", "sgd"], "precision-aware optimizer is Adam only; use --optimizer adam"),
    ],
)
def test_megatron_refuses_what_megatron_core_cannot_run_here_or_runs_wrongly(flags, expected):
    message = refusal("megatron", *flags)
    assert expected in message, message


def test_the_fp32_refusal_names_both_missing_flags_at_once():
    message = refusal("megatron", "--optimizer-cpu-offload")
    assert (
        "--use-precision-aware-optimizer (" in message
        and "--bf16 (" in message
        and message.endswith("add them")
    )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--optimizer-cpu-offload"], "--optimizer-cpu-offload: "),
        (["--overlap-cpu-optimizer-d2h-h2d"], "--overlap-cpu-optimizer-d2h-h2d: "),
        (["--use-precision-aware-optimizer"], "--use-precision-aware-optimizer: "),
        (["--optimizer-offload-fraction", "0.5"], "--optimizer-offload-fraction 0.5: "),
        (
            [*SLIME_30B, "--bf16"],
            "--optimizer-cpu-offload, --overlap-cpu-optimizer-d2h-h2d, --use-precision-aware-optimizer: ",
        ),
    ],
)
def test_fsdp_refuses_the_cpu_optimizer_flags_with_the_reason(flags, named):
    message = refusal("fsdp", *flags)
    assert message.startswith(named), message
    assert "Megatron-Core's hybrid CPU/GPU optimizer, which the fsdp backend does not have" in message
    assert (
        "CPUOffloadPolicy" in message
        and "--train-backend megatron" in message
        and "--offload-train" in message
    )


def test_the_config_is_one_megatron_core_accepts():
    """Where megatron-core is installed (the GPU machine): OptimizerConfig takes vime's fields, and with the offload
    it skips its TransformerEngine check."""
    optimizer = pytest.importorskip("megatron.core.optimizer")
    config = optimizer.OptimizerConfig(
        **optimizer_config_kwargs(parse("megatron", *SLIME_30B, "--bf16"), 1e-6)
    )
    assert config.optimizer_cpu_offload and config.use_precision_aware_optimizer
    assert config.optimizer_offload_fraction == 1.0


class _Hybrid(torch.optim.Optimizer):
    """What vime relies on of Megatron-Core's HybridDeviceOptimizer: a torch optimizer over the model's parameters
    whose work is done by ``sub_optimizers``, each over its own copies (here: a "CPU" and a "GPU" half)."""

    def __init__(self, params, halves):
        super().__init__(params, defaults={"lr": 0.1, "betas": (0.9, 0.999)})
        self.halves = halves

    @property
    def sub_optimizers(self):
        return self.halves


def test_the_hybrid_optimizers_halves_are_what_offload_and_the_memory_plan_see():
    model_params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)) for _ in range(2)]
    cpu_copy, gpu_copy = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))
    halves = [torch.optim.AdamW([cpu_copy]), torch.optim.AdamW([gpu_copy])]
    hybrid = _Hybrid(model_params, halves)
    wrapper = argparse.Namespace(optimizer=hybrid)  # Megatron's DistributedOptimizer holds it as .optimizer
    assert torch_optimizers(wrapper) == halves
    cpu_copy.grad = torch.ones(4)
    halves[0].step()
    tensors = optimizer_tensors(wrapper)
    assert any(t is cpu_copy for t in tensors) and any(t is gpu_copy for t in tensors)
    assert any(t is halves[0].state[cpu_copy]["exp_avg"] for t in tensors)
    assert not any(t is p for t in tensors for p in model_params)  # the weights are offloaded as the model's
    # the memory plan counts the moments still to come, on the device asked about only
    assert unallocated_optimizer_state_bytes(halves) == 2 * 3 * 4  # gpu_copy's two fp32 moments
    assert unallocated_optimizer_state_bytes(halves, "cpu") == 2 * 3 * 4
    assert unallocated_optimizer_state_bytes(halves, "cuda") == 0  # all of it lives on the CPU here
