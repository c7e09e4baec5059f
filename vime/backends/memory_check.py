"""The memory check a trainer runs before its first step: two small synthetic forward/backward passes predict the
peak memory of the largest planned micro-batch (:mod:`vime.utils.memory_plan`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from vime.utils.memory_plan import (
    GIB,
    MemoryPlan,
    MemoryProbe,
    optimizer_step_bytes,
    plan_memory,
    planned_micro_batch_tokens,
    unallocated_optimizer_state_bytes,
)
from vime.utils.offload import torch_optimizers
from vime.utils.types import Sample


def _synthetic_samples(total_tokens: int, sample_tokens: int) -> list[Sample]:
    """Samples of ``sample_tokens`` tokens (the last one shorter) totalling ``total_tokens``, each a one-token
    prompt and a response (every position goes through the LM head, the worst case for memory)."""
    generator = torch.Generator().manual_seed(0)
    samples = []
    while total_tokens >= 2:
        length = min(sample_tokens, total_tokens)
        tokens = torch.randint(0, 32, (length,), generator=generator).tolist()  # in any vocabulary
        samples.append(Sample(index=len(samples), tokens=tokens, response_length=length - 1))
        total_tokens -= length
    return samples


def check_memory_plan(trainer) -> MemoryPlan | None:
    """Before ``trainer``'s first step (CUDA only): predict the peak memory of the largest micro-batch the plan allows
    from two smaller synthetic forward/backward passes (:mod:`vime.utils.memory_plan`) and fail now, on every
    rank, with the numbers and the flags to change when it cannot fit. Collective."""
    tokens = planned_micro_batch_tokens(trainer.args, trainer._micro_batch_token_budget())
    if not torch.cuda.is_available() or tokens is None or tokens < 64:
        return None
    resident = torch.cuda.memory_allocated() + trainer._probe_gradient_bytes()
    free, _ = torch.cuda.mem_get_info()
    available = free + torch.cuda.memory_reserved()
    probes = []
    for size in (
        min(tokens // 4, 2048),
        min(tokens // 2, 4096),
    ):  # small: a probe must not run out itself
        torch.cuda.reset_peak_memory_stats()
        try:
            trainer._memory_probe(_synthetic_samples(size, _longest_sample(trainer.args, size)))
        except torch.OutOfMemoryError as e:
            raise MemoryError(
                f"the {trainer.role}'s memory check ran out of GPU memory on a micro-batch of only {size} tokens "
                f"({available / GIB:.1f} GiB usable): the model does not fit this GPU as configured; "
                "spread it over more GPUs (tensor, pipeline or expert parallelism)"
            ) from e
        probes.append(MemoryProbe(size, torch.cuda.max_memory_allocated()))
    torch.cuda.empty_cache()
    optimizers = torch_optimizers(trainer.optimizer)
    missing = unallocated_optimizer_state_bytes(optimizers, "cuda")
    plan = plan_memory(
        *probes, tokens, resident, missing, available, optimizer_step_bytes(optimizers, "cuda")
    )
    any_over = _world_max([0 if plan.fits else 1])[0]
    if plan.fits and not any_over:
        tight = "warning: tight, " if plan.predicted_peak_bytes > 0.9 * available else ""
        print(f"[vime] {trainer.role} memory plan: {tight}{plan.summary()}", flush=True)
        return plan
    if plan.fits:
        raise MemoryError("another training rank's micro-batch plan does not fit in its GPU memory")
    args = trainer.args
    if not plan.step_fits:
        offload = "" if args.train_backend == "fsdp" else "turn on --optimizer-cpu-offload, or "
        raise MemoryError(
            f"the {trainer.role}'s {plan.summary()}: the optimizer step alone does not fit, whatever the "
            f"micro-batch; {offload}spread the model over more GPUs (this process can use {available / GIB:.1f} "
            "GiB of this GPU)"
        )
    fix = "--gradient-checkpointing" if args.train_backend == "fsdp" else "--recompute-granularity full"
    if args.use_dynamic_batch_size:  # the budget may be --max-tokens-per-gpu x CP
        lower = f"--max-tokens-per-gpu {plan.max_fitting_tokens * args.max_tokens_per_gpu // tokens}"
    else:
        lower = f"--micro-batch-size {plan.max_fitting_tokens * args.micro_batch_size // tokens}"
    raise MemoryError(
        f"the {trainer.role}'s {plan.summary()}. Set {lower} or lower, turn on {fix}, or spread the model "
        f"over more GPUs (this process can use {available / GIB:.1f} GiB of this GPU)"
    )


def _longest_sample(args, tokens: int) -> int:
    """Length of the synthetic samples a memory probe packs: the longest sample the run can produce."""
    longest = (
        args.rollout_max_context_len or (args.rollout_max_prompt_len or 0) + args.rollout_max_response_len
    )
    return max(min(longest, tokens), 2)


def _world_max(values: list[int]) -> list[int]:
    """Element-wise maximum over every rank."""
    tensor = torch.tensor(values, dtype=torch.int64, device="cuda")
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()
