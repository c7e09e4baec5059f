"""Weight-sync throughput: a trainer in this process pushes its bf16 weights into a real vLLM engine, as
``train.py`` does, over each ``--transport`` (GB/s of weights moved, pause to resume), next to the GPU's
device-to-device copy bandwidth measured in the same run. MoE experts go stacked (one tensor per layer and
projection, what ``train.py`` sends over ``tensor``/``distributed``) or per expert (``--expert-layouts``).

Cases (transport x expert layout; ``disk`` always writes per-expert HF files) alternate within each repeat; the
first repeat is a warm-up. Before every sync the trainer's weights are perturbed (noise), and after it the engine's
log-probs of a fixed sequence must match the trainer's within ``--logprob-tol`` while the engine's log-probs from
before the sync must not (so a sync that loads nothing fails). The JSON (median, min, max per case) is rewritten
after every repeat. The weights check that ``train.py`` runs after every sync (``--check-weight-update-equal``, on by
default; ``--no-check-weight-update-equal`` here leaves it out) is timed apart: ``checksum_s`` (the engine records
its checksums, inside pause -> resume), ``check_trainer_s`` (the trainer scores the check sequence) and ``check_s``
(the engine's checksums and probe checked, after resume).

    python bench/weight_sync.py --shape 4b --transports tensor disk          # one GPU: the engine beside the trainer
    python bench/weight_sync.py --shape 4b --transports distributed          # two GPUs: the engine on the second
    python bench/weight_sync.py --shape 30b-a3b-4l --transports tensor --expert-layouts stacked per-expert --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from bench.shapes import build_shape, env_entries, trainer_flags, write_result  # noqa: E402
from vime.utils import weight_check  # noqa: E402

EXTENSION = ["--worker-extension-cls", "vime.backends.vllm_utils.worker_extension.VimeWorkerExtension"]
SEQUENCE = [5, 17, 9, 30, 12, 7, 22, 14, 3, 40, 11, 26, 8, 19, 33, 4]


def trainer_sequence_log_probs(trainer, tokens: list[int]) -> list[float]:
    """The trainer's side of the weights check's probe (``train_group.sequence_log_probs``)."""
    from vime.utils.types import Sample, Status

    sample = Sample(index=0, tokens=tokens, response_length=len(tokens) - 1, status=Status.COMPLETED)
    return trainer.compute_log_probs([sample])[0].tolist()


def copy_bandwidth_gb_s(nbytes: int = 4 * 2**30) -> float:
    """Device-to-device copy, bytes read + written per second (the ceiling of any on-GPU move)."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (time.perf_counter() - started) / 1e9


def engine_log_probs(url: str, model: str) -> torch.Tensor:
    import json
    import urllib.request

    body = {"model": model, "prompt": SEQUENCE, "max_tokens": 1, "prompt_logprobs": 0}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=120) as resp:
        entries = json.loads(resp.read())["choices"][0]["prompt_logprobs"]
    return torch.tensor([e[str(t)]["logprob"] for e, t in zip(entries[1:], SEQUENCE[1:], strict=True)])


@torch.no_grad()
def perturb(model: torch.nn.Module, generator: torch.Generator, built: list[torch.Tensor]) -> None:
    """Set each weight matrix to its built value (kept in ``built``, filled on the first call) plus fresh noise of
    half its standard deviation, so the model stays as far from the built one at every repeat instead of drifting
    (norms and biases are left as they are)."""
    matrices = [
        param.to_local() if isinstance(param, DTensor) else param  # FSDP2: this rank's shard
        for param in model.parameters()
    ]
    matrices = [m for m in matrices if m.dim() >= 2 and m.is_floating_point()]
    if not built:
        built.extend(m.detach().clone() for m in matrices)
    for param, original in zip(matrices, built, strict=True):
        noise = torch.randn(param.shape, generator=generator, device=generator.device, dtype=torch.float32)
        param.copy_((original.float() + noise * (0.5 * original.float().std())).to(param.dtype))


def summarize(runs: list[dict]) -> dict:
    """Median, min and max GB/s and seconds of a case's timed syncs, the median seconds of each phase (the
    transport's ``phases``, and ``control_s``: pause, prefix-cache reset and resume around the move), its bytes
    and its log-prob checks."""
    rates = [r["gb_per_s"] for r in runs]
    return {
        "gb_per_s": statistics.median(rates),
        "gb_per_s_min": min(rates),
        "gb_per_s_max": max(rates),
        "time_s": statistics.median(r["time_s"] for r in runs),
        "phases_s": {
            phase: statistics.median(r["phases_s"].get(phase, 0.0) for r in runs)
            for phase in sorted({phase for r in runs for phase in r["phases_s"]})
        },
        "bytes": runs[-1]["bytes"],
        "engine_vs_trainer_logprob_abs_diff_max": max(r["logprob_diff"] for r in runs),
        "stale_logprob_abs_diff_min": min(r["stale_logprob_diff"] for r in runs),
        "runs": runs,
    }


def parse_options(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict[str, str]]:
    """The benchmark's options and its ``--env`` entries; refuses a run mixing ``tensor`` with ``distributed``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="4b")
    p.add_argument("--backend", choices=["megatron", "fsdp"], default="megatron")
    p.add_argument(
        "--transports", nargs="+", choices=["tensor", "distributed", "disk"], default=["tensor", "disk"]
    )
    p.add_argument(
        "--buffer-size-mb",
        type=int,
        nargs="+",
        default=[1024],
        help="--update-weight-buffer-size; several sizes are timed alternately in one run",
    )
    p.add_argument("--expert-layouts", nargs="+", choices=["stacked", "per-expert"], default=["stacked"])
    p.add_argument("--repeats", type=int, default=5, help="timed syncs per case after a warm-up one")
    p.add_argument(
        "--logprob-tol", type=float, default=0.05, help="mean |engine - trainer| log-prob bound (bf16)"
    )
    p.add_argument(
        "--env",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="environment for this process and the engine, e.g. NCCL settings to compare (NCCL_MIN_NCHANNELS=32)",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=8.0,
        help="the engine's KV cache (--vllm-kv-cache-memory-bytes): vLLM's prefix-cache reset after every sync walks "
        "every block, so a few-layer shape given a whole GPU (about 760k blocks for 30b-a3b-4l at 0.8 of an H200) "
        "pays for a pool 12 x larger than its 48-layer model would have; 0 sizes it by the GPU share",
    )
    p.add_argument("--out", default=None)
    p.add_argument(
        "--no-check-weight-update-equal", dest="check", action="store_false", help="no weights check"
    )
    opts = p.parse_args(argv)
    if {"tensor", "distributed"} <= set(opts.transports):
        # distributed puts the engine on the second GPU; CUDA IPC (tensor) only reaches an engine on the trainer's
        # GPU, as train.py's --colocate places it (a 2 x H100 run with both once lost its engine at the tensor case)
        p.error(
            "--transports tensor and distributed need different engine placements (the trainer's GPU, the second "
            "GPU): run them in two invocations, e.g. --transports tensor disk, then --transports distributed"
        )
    return opts, env_entries(p, "--env", opts.env)


def main() -> None:
    opts, env = parse_options()
    os.environ.update(env)

    from vime.backends.vllm_utils.engine import VLLMEngine
    from vime.backends.vllm_utils.weight_sync import make_transport, sync_weights
    from vime.ray.weight_update import WeightUpdate
    from vime.utils.arguments import parse_args
    from vime.utils.distributed import init_distributed
    from vime.utils.types import Sample, Status

    init_distributed()
    model_dir = build_shape(opts.shape)
    split = "distributed" in opts.transports
    if split and torch.cuda.device_count() < 2:
        raise SystemExit("--transports distributed needs a second GPU for the engine")
    work = Path(tempfile.mkdtemp(prefix="vime-sync-"))
    argv = trainer_flags(opts.backend, model_dir) + [
        "--prompt-data", "unused.jsonl", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
        "--num-rollout", "1", "--update-weight-buffer-size", str(opts.buffer_size_mb[0] * 2**20),
        "--vllm-enforce-eager", "--vllm-max-model-len", "256",
        "--vllm-gpu-memory-utilization", "0.8" if split else "0.3",
    ] + (["--vllm-kv-cache-memory-bytes", str(int(opts.kv_cache_gib * 2**30))] if opts.kv_cache_gib else [])  # fmt: skip
    argv += [] if opts.check else ["--no-check-weight-update-equal"]
    args = parse_args(argv + (["--colocate"] if "tensor" in opts.transports else []))
    weights_check = WeightUpdate(SimpleNamespace(args=args, log_dir=work), None, None)
    if opts.backend == "megatron":
        from vime.backends.megatron_utils.trainer import MegatronTrainer as Trainer
    else:
        from vime.backends.fsdp_utils.trainer import FSDPTrainer as Trainer
    trainer = Trainer(args)
    model = trainer.module if opts.backend == "megatron" else trainer.model
    sample = Sample(index=0, tokens=SEQUENCE, response_length=len(SEQUENCE) - 1, status=Status.COMPLETED)
    ceiling = copy_bandwidth_gb_s()
    gpu = "1" if split else os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    engine = VLLMEngine(
        args, log_path=work / "engine.log", extra_args=EXTENSION, env={**env, "CUDA_VISIBLE_DEVICES": gpu}
    )
    cases = [
        (transport, layout, buffer_mb)
        for transport in opts.transports
        for layout in (["per-expert"] if transport == "disk" else opts.expert_layouts)
        for buffer_mb in opts.buffer_size_mb
    ]
    several_sizes = len(opts.buffer_size_mb) > 1

    def case_name(transport: str, layout: str, buffer_mb: int) -> str:
        return f"{transport}/{layout}" + (f"/{buffer_mb}MiB" if several_sizes else "")

    runs: dict[str, list[dict]] = {case_name(*case): [] for case in cases}
    generator = torch.Generator(device="cuda").manual_seed(0)
    built: list[torch.Tensor] = []
    name = f"weight_sync_{opts.backend}_{opts.shape}_{'2gpu' if split else '1gpu'}"
    version = 0
    check_tokens = weight_check.check_tokens(str(model_dir)) if args.check_weight_update_equal else None
    try:
        engine.start().wait_ready_sync()
        for repeat in range(opts.repeats + 1):
            for transport_name, layout, buffer_mb in cases:
                case = case_name(transport_name, layout, buffer_mb)
                args.update_weight_transport = transport_name
                args.update_weight_buffer_size = buffer_mb * 2**20
                transport = make_transport(args, [engine.url], str(work / "weights"), 0)
                perturb(model, generator, built)
                want = trainer.compute_log_probs([sample])[0]
                started = time.perf_counter()
                expected = trainer_sequence_log_probs(trainer, check_tokens) if check_tokens else None
                check_trainer_s = time.perf_counter() - started
                before = engine_log_probs(engine.url, str(model_dir))
                buckets = trainer.iter_weight_buckets(
                    args.update_weight_buffer_size,
                    stack_experts=layout == "stacked" and transport.stacks_experts,
                )
                version += 1
                metrics = sync_weights(
                    [engine.url], buckets, transport, version, record_checksums=args.check_weight_update_equal
                )
                started = time.perf_counter()
                if expected is not None:  # what train.py checks after the sync (it raises on a mismatch)
                    weights_check.check_engines([engine.url], expected, version)
                check_s = time.perf_counter() - started
                diff = float((engine_log_probs(engine.url, str(model_dir)) - want).abs().mean())
                stale = float((before - want).abs().mean())
                phases = dict(transport.phases)
                checksum_s = metrics.get("weight_sync/checksum_s", 0.0)
                phases.update(
                    {phase: metrics[f"weight_sync/{phase}"] for phase in ("pause_s", "reset_s", "resume_s")},
                    control_s=metrics["weight_sync/time_s"]
                    - phases.get("move_s", 0.0)
                    - phases.get("write_s", 0.0)
                    - checksum_s,
                )
                # the weights check: checksum_s inside time_s, the other two after it
                if expected is not None:
                    phases |= {
                        "checksum_s": checksum_s,
                        "check_trainer_s": check_trainer_s,
                        "check_s": check_s,
                    }
                run = {
                    "gb_per_s": metrics["weight_sync/gb_per_s"],
                    "time_s": metrics["weight_sync/time_s"],
                    "phases_s": {phase: round(seconds, 5) for phase, seconds in phases.items()},
                    "bytes": metrics["weight_sync/bytes"],
                    "logprob_diff": diff,
                    "stale_logprob_diff": stale,
                }
                print(f"[bench] repeat {repeat} {case}: {run}", flush=True)
                if diff > opts.logprob_tol or stale <= opts.logprob_tol:
                    raise SystemExit(
                        f"{case}: engine vs trainer log-probs differ by {diff:.3g} after the sync "
                        f"and by {stale:.3g} before it; the bound is {opts.logprob_tol} (--logprob-tol): the sync "
                        "did not load the trainer's weights, or the perturbation does not show"
                    )
                if repeat > 0:
                    runs[case].append(run)
            if repeat > 0:
                write_summary(opts, name, ceiling, {case: summarize(r) for case, r in runs.items()})
    finally:
        engine.stop()


def write_summary(opts: argparse.Namespace, name: str, ceiling: float, results: dict[str, dict]) -> None:
    """The benchmark's JSON with every case's figures so far."""
    summary = ", ".join(
        f"{case} {r['gb_per_s']:.1f} GB/s ({r['gb_per_s_min']:.1f}-{r['gb_per_s_max']:.1f}, {r['time_s']:.3f} s: "
        + " ".join(f"{phase.removesuffix('_s')} {seconds:.3f}" for phase, seconds in r["phases_s"].items())
        + ")"
        for case, r in results.items()
    )
    repeats = min(len(r["runs"]) for r in results.values())
    write_result(
        opts.out or f"bench/results/{name}.json",
        {
            "benchmark": "weight_sync",
            "workload": {
                "shape": opts.shape,
                "backend": opts.backend,
                "buffer_mb": opts.buffer_size_mb,
                "engine_gpu": "second GPU" if "distributed" in opts.transports else "the trainer's GPU",
                "repeats": repeats,
                "logprob_tol": opts.logprob_tol,
                "kv_cache_gib": opts.kv_cache_gib,
                "env": opts.env,
            },  # fmt: skip
            "device_copy_gb_per_s": ceiling,
            "cases": results,
            "summary": f"{name} (median of {repeats}, min-max): {summary}; device copy {ceiling:.0f} GB/s",
        },
    )


if __name__ == "__main__":
    main()
