"""Trainer throughput: one GRPO training step of a realistic shape (old-log-prob forward + forward/backward +
optimizer step), tokens/s and MFU, for the Megatron or the FSDP backend, on 1 GPU or more (``torchrun``).

MFU counts model FLOPs as in the issue: ``8 x params x tokens`` per step (2 for the old-log-prob forward, 6 for
forward + backward; recompute and attention are not counted), against the dense bf16 peak (989 TFLOP/s for H100
and H200). Step 0 is warm-up; the median of the others is reported.

    python bench/trainer_throughput.py --backend megatron --recompute full         # one GPU
    torchrun --nproc-per-node 2 bench/trainer_throughput.py --backend fsdp --recompute full
    python bench/trainer_throughput.py --backend megatron --profile                # + a kernel table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH

import torch  # noqa: E402

from bench.shapes import MOE_SHAPE, PEAK_BF16_FLOPS, build_shape, matmul_params, trainer_flags, write_result  # noqa: E402


def trainer_argv(opts, model_dir: Path) -> list[str]:
    argv = trainer_flags(opts.backend, model_dir) + [
        "--prompt-data", "unused.jsonl",
        "--rollout-batch-size", str(opts.samples // opts.n_samples), "--n-samples-per-prompt", str(opts.n_samples),
        "--global-batch-size", str(opts.samples), "--num-rollout", "100", "--lr", "1e-6",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(opts.max_tokens_per_gpu),
    ]  # fmt: skip
    if opts.backend == "megatron":
        if opts.recompute == "full":
            argv += [
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            ]
        elif opts.recompute == "selective":
            argv += ["--recompute-granularity", "selective"]
        argv += ["--use-distributed-optimizer"] if int(os.environ.get("WORLD_SIZE", "1")) > 1 else []
        argv += ["--moe-grouped-gemm"] if opts.grouped_gemm and MOE_SHAPE.fullmatch(opts.shape) else []
    elif opts.recompute != "none":
        argv += ["--gradient-checkpointing"]
    return argv + opts.extra


def synthetic_samples(opts, vocab: int):
    """``--samples`` samples of ``--seq-len`` tokens drawn from the model's ``vocab`` (``--response-len`` of them
    the response), rewards 0/1. (Before 2026-11-28 the tokens came from the first 61 ids only: a MoE router then saw
    57 distinct tokens in the first layer.)"""
    from vime.utils.types import Sample, Status

    g = torch.Generator().manual_seed(0)
    return [
        Sample(index=i, group_index=i // opts.n_samples, tokens=torch.randint(4, vocab, (opts.seq_len,), generator=g).tolist(),
               response_length=opts.response_len, reward=float(i % 2), status=Status.COMPLETED)
        for i in range(opts.samples)
    ]  # fmt: skip


def profile_report(prof, wall_s: float, rows: int = 40) -> str:
    """The profiled step's GPU busy time (the sum of its kernels' durations) against its wall time, then its ops by
    GPU time and by host time (the host-side table shows synchronisations and launch-bound stretches)."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_s = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
    averages = prof.key_averages()
    return "\n".join([
        f"profiled step: wall {wall_s:.3f} s, kernels {busy_s:.3f} s ({busy_s / wall_s:.0%} busy), {len(kernels):,} launches",
        averages.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70),
        averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70),
        host_syncs(prof),
        gpu_idle_gaps(prof.events()),
    ])  # fmt: skip


def host_syncs(prof, rows: int = 15) -> str:
    """Where the host waits for the GPU (``cudaStreamSynchronize``: a ``.item()``, ``.tolist()`` or a copy to the
    CPU), by the Python call site of the op that waited: each wait drains the GPU's queue, which then idles while
    the host launches again."""
    sites: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.name != "cudaStreamSynchronize":
            continue
        site = sites[_call_site(event)]
        site[0] += 1
        site[1] += event.time_range.elapsed_us() / 1e6
    lines = [
        f"host syncs: {sum(n for n, _ in sites.values()):,} in the step, by call site (count, host time waiting)"
    ]
    for (name, *stack), (count, seconds) in sorted(sites.items(), key=lambda item: -item[1][0])[:rows]:
        lines.append(f"{count:>7,} {seconds:8.3f} s  {name}")
        lines.extend(f"          {frame}" for frame in stack)
    return "\n".join(lines)


def _call_site(op) -> tuple[str, ...]:
    """An op's name and the first Python frames of the nearest op above it (itself included) that has a stack."""
    name = op.name
    while op.cpu_parent is not None and not op.stack:
        op = op.cpu_parent
    return (name, *op.stack[:6])


def gpu_idle_gaps(events, rows: int = 15, min_gap_us: float = 5.0) -> str:
    """Where the GPU waits for the host: every gap of at least ``min_gap_us`` between the kernels (all streams
    merged), charged to the Python call site of the op whose kernel ends it (the host was busy getting there: in a
    wait for the GPU just before, or in Python and launches). A kernel is traced to the runtime call that launched
    it (``cudaLaunchKernel``, ``cudaMemcpyAsync``...: the same CUPTI correlation id), then to the op around that call;
    torch 2.11's events have no ``linked_correlation_id``, and the profiler's own events carry id 0."""
    kernels = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    launches = {  # CPU ops have ids of their own, which may equal a launch's: runtime calls are told by name
        e.id: e
        for e in events
        if e.device_type == torch.autograd.DeviceType.CPU and e.id and e.name.startswith(("cuda", "cu"))
    }
    sites: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0, 0.0])
    busy_until = kernels[0].time_range.end if kernels else 0
    total_us = 0.0
    for kernel in kernels[1:]:
        gap = kernel.time_range.start - busy_until
        busy_until = max(busy_until, kernel.time_range.end)
        if gap < min_gap_us:
            continue
        total_us += gap
        launch = launches.get(kernel.id)  # never id 0: the profiler's own
        if launch is None:
            site = sites[(f"(kernel {kernel.name}: its launch not recorded)",)]
        else:
            site = sites[_call_site(launch.cpu_parent or launch)]
        site[0] += 1
        site[1] += gap / 1e6
    lines = [
        f"GPU idle: {total_us / 1e6:.3f} s in {sum(n for n, _ in sites.values()):,} gaps of >= {min_gap_us:g} us, "
        "by the call site of the op whose kernel ended the gap (count, idle time)"
    ]
    for (name, *stack), (count, seconds) in sorted(sites.items(), key=lambda item: -item[1][1])[:rows]:
        lines.append(f"{count:>7,} {seconds:8.3f} s  {name}")
        lines.extend(f"          {frame}" for frame in stack)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["megatron", "fsdp"], default="megatron")
    p.add_argument("--shape", default="4b")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--n-samples", type=int, default=8, help="samples per prompt (GRPO groups)")
    p.add_argument("--seq-len", type=int, default=524)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--max-tokens-per-gpu", type=int, default=8192)
    p.add_argument("--recompute", choices=["none", "full", "selective"], default="full")
    p.add_argument("--steps", type=int, default=3, help="steps after the warm-up one")
    p.add_argument(
        "--grouped-gemm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--moe-grouped-gemm for MoE shapes (Megatron); --no-grouped-gemm runs the experts one by one",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile one more step after the timed ones (GPU busy share, ops by GPU and by host time, host syncs by call site; in $OUT)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch's CPU threads (default 1: what train.py's trainers get, as Ray sets OMP_NUM_THREADS=1 for "
        "actors that take no CPU; 0 keeps torch's default, one per core)",
    )
    p.add_argument(
        "--out", default=None, help="JSON path (default bench/results/trainer_<backend>_<...>.json)"
    )
    p.add_argument("extra", nargs="*", help="more vime flags, after --")
    opts = p.parse_args()

    from vime.utils.arguments import parse_args
    from vime.utils.distributed import init_distributed
    from vime.utils.train_data import shape_rewards

    if opts.torch_threads:
        torch.set_num_threads(opts.torch_threads)
    init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model_dir = build_shape(opts.shape) if rank == 0 else None
    box = [str(model_dir) if model_dir else None]
    torch.distributed.broadcast_object_list(box, 0)
    model_dir = Path(box[0])
    args = parse_args(trainer_argv(opts, model_dir))
    if opts.backend == "megatron":
        from vime.backends.megatron_utils.trainer import MegatronTrainer as Trainer
    else:
        from vime.backends.fsdp_utils.trainer import FSDPTrainer as Trainer
    config = (
        f"{opts.backend}_{opts.shape}_{world}gpu_recompute-{opts.recompute}_mtpg{opts.max_tokens_per_gpu}"
    ) + ("_sequential-experts" if MOE_SHAPE.fullmatch(opts.shape) and not opts.grouped_gemm else "")
    config += "" if opts.torch_threads == 1 else f"_threads{torch.get_num_threads()}"
    out_path = opts.out or f"bench/results/trainer_{config}.json"
    started = time.monotonic()
    try:
        trainer = Trainer(args)
    except MemoryError as e:  # the memory plan refused the micro-batch before any step
        if rank == 0:
            print(f"[bench] {config}: refused before the first step: {e}", flush=True)
            write_result(out_path, {"benchmark": "trainer_throughput", "config": config, "refused": str(e),
                                    "build_s": time.monotonic() - started, "summary": f"{config}: refused"})  # fmt: skip
        torch.distributed.destroy_process_group()
        return
    build_s = time.monotonic() - started
    plan = trainer.memory_plan
    predicted_gib = plan.predicted_peak_bytes / 2**30 if plan else None
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    samples = synthetic_samples(opts, vocab)
    groups = [samples[i : i + opts.n_samples] for i in range(0, len(samples), opts.n_samples)]
    rewards = shape_rewards(args, groups)
    from vime.utils.train_data import split_rollout

    mine = split_rollout([len(s.tokens) for s in samples], trainer.dp_size, opts.samples)[trainer.dp_rank]
    my_samples, my_rewards = [samples[i] for i in mine], [rewards[i] for i in mine]

    timings = []
    prof_text = None
    for step in range(opts.steps + 1 + opts.profile):
        profiling = opts.profile and step == opts.steps + 1  # an extra step, not timed: the profiler slows it
        prof = None
        if profiling:
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            stacks = torch._C._profiler._ExperimentalConfig(verbose=True)  # Python stacks on the ops' events
            prof = torch.profiler.profile(activities=activities, with_stack=True, experimental_config=stacks)
            prof.__enter__()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        log_probs = trainer.compute_log_probs(my_samples)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        trainer.train(step, my_samples, my_rewards, log_probs=log_probs)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if prof is not None:
            prof.__exit__(None, None, None)
            prof_text = profile_report(prof, t2 - t0)
        if not profiling:
            timings.append((t1 - t0, t2 - t1))
        if rank == 0:
            what = "profiled step" if profiling else "step"
            print(f"[bench] {what} {step}: log-probs {t1 - t0:.2f} s, train {t2 - t1:.2f} s", flush=True)
    measured = timings[1:] if len(timings) > 1 else timings
    log_prob_s = statistics.median(t for t, _ in measured)
    train_s = statistics.median(t for _, t in measured)
    total_s = log_prob_s + train_s
    tokens = opts.samples * opts.seq_len
    params = matmul_params(model_dir)
    flops = 8 * params * tokens
    mfu = flops / total_s / (PEAK_BF16_FLOPS * world)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    if rank == 0:
        if prof_text:
            out_dir = Path(os.environ.get("OUT", "/tmp"))
            name = f"profile_{opts.backend}_{opts.shape}_{opts.recompute}_{world}gpu.txt"
            (out_dir / name).write_text(prof_text)
            print(prof_text[:6000])
        write_result(
            out_path,
            {
                "benchmark": "trainer_throughput",
                "workload": {
                    "backend": opts.backend,
                    "shape": opts.shape,
                    "gpus": world,
                    "samples": opts.samples,
                    "seq_len": opts.seq_len,
                    "response_len": opts.response_len,
                    "recompute": opts.recompute,
                    "max_tokens_per_gpu": opts.max_tokens_per_gpu,
                    "matmul_params": params,
                    "torch_threads": torch.get_num_threads(),
                    "extra": opts.extra,
                },  # fmt: skip
                "build_s": build_s,
                "log_prob_s": log_prob_s,
                "train_s": train_s,
                "step_s": total_s,
                "tokens_per_s": tokens / total_s,
                "mfu": mfu,
                "peak_memory_gib": peak_gib,
                "predicted_peak_memory_gib": predicted_gib,
                "runs": timings,
                "summary": f"{config}: {total_s:.2f} s/step (log-probs {log_prob_s:.2f} + train {train_s:.2f}), "
                f"{tokens / total_s:,.0f} tok/s, MFU {mfu:.1%}, peak {peak_gib:.1f} GiB (predicted {predicted_gib})",
            },
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
