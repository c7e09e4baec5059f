"""Memory over many weight syncs (issue 24, item 5): a trainer in this process syncs its weights into one real vLLM
engine ``--syncs`` times, as ``train.py`` does after every step, perturbing them before each sync so that every
sync moves new values. Every ``--every`` syncs it records each process of the engine's process group: USS (pages
only that process holds), PSS (shared pages split among their sharers) and RSS, and their sums (USS and PSS add up;
summed RSS counts shared pages more than once, so it is reported but not judged); on GPU also the GPU memory
in use and the trainer's own host memory. The verdict compares the engine group's USS at the first sample at or
after ``--warmup`` syncs with the last one (issue bar: < 1 % on CPU over 500 syncs; < 1 % or < 64 MiB on GPU over
200): a leak shows in the pages a process holds alone, while PSS also moves when other processes on the machine
start or stop sharing its libraries. The JSON is rewritten after every sample.

    python bench/sync_soak.py                                   # CPU: tiny model, distributed (gloo), 500 syncs
    python bench/sync_soak.py --transport disk --syncs 200
    python bench/sync_soak.py --generate 512                    # a rollout's worth of samples between syncs
    bash bench/run.sh bench/sync_soak.py --shape 0.6b --syncs 200 --transport tensor   # GPU, engine beside it
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH

import psutil  # noqa: E402
import torch  # noqa: E402

from bench.shapes import build_shape, env_entries, write_result  # noqa: E402

EXTENSION = ["--worker-extension-cls", "vime.backends.vllm_utils.worker_extension.VimeWorkerExtension"]
MIB = 2**20


def process_memory(processes: list[psutil.Process]) -> dict:
    """USS, PSS and RSS (MiB) of each of ``processes`` still alive, and their sums."""
    rows = []
    for process in processes:
        try:
            info = process.memory_full_info()
            rows.append(
                {
                    "pid": process.pid,
                    "name": " ".join(process.cmdline()[:3])[-60:],
                    "uss_mib": info.uss / MIB,
                    "pss_mib": info.pss / MIB,
                    "rss_mib": info.rss / MIB,
                }
            )
        except psutil.NoSuchProcess:
            continue
    totals = {key: sum(row[key] for row in rows) for key in ("uss_mib", "pss_mib", "rss_mib")}
    return {"processes": rows, **totals}


def gpu_memory_mib() -> float | None:
    """GPU memory in use on this machine's first GPU (every process), or None without one."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / MIB


@torch.no_grad()
def perturb(model: torch.nn.Module, generator: torch.Generator, built: list[torch.Tensor]) -> None:
    """Each floating-point parameter becomes its built value plus small fresh noise (no drift across syncs)."""
    params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    params = [p for p in params if p.is_floating_point()]
    if not built:
        built.extend(p.detach().clone() for p in params)
    for param, original in zip(params, built, strict=True):
        noise = torch.randn(param.shape, generator=generator, device=param.device, dtype=torch.float32)
        param.copy_((original.float() + 1e-3 * noise).to(param.dtype))


def generate(url: str, model: str, prompts: list[str], count: int) -> None:
    """``count`` one-token samples with their log-probs, in one request, as vime's rollout asks them one by one."""
    body = {
        "model": model,
        "prompt": [prompts[i % len(prompts)] for i in range(count)],
        "max_tokens": 1,
        "temperature": 1.0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=300) as response:
        if len(json.loads(response.read())["choices"]) != count:
            raise RuntimeError(f"the engine at {url} answered fewer than {count} samples")


def verdict(samples: list[dict], warmup: int) -> dict:
    """The engine group's USS (and PSS) growth from the first sample at or after ``warmup`` syncs to the last."""
    after = [s for s in samples if s["syncs"] >= warmup]
    if len(after) < 2:
        return {}
    first, last = after[0], after[-1]
    growth = last["engine"]["uss_mib"] - first["engine"]["uss_mib"]
    result = {
        "from_sync": first["syncs"],
        "to_sync": last["syncs"],
        "engine_uss_growth_mib": growth,
        "engine_uss_growth_pct": 100 * growth / first["engine"]["uss_mib"],
        "engine_uss_growth_kib_per_sync": 1024 * growth / (last["syncs"] - first["syncs"]),
        "engine_pss_growth_mib": last["engine"]["pss_mib"] - first["engine"]["pss_mib"],
        "trainer_pss_growth_mib": last["trainer_pss_mib"] - first["trainer_pss_mib"],
    }
    if first.get("gpu_mib") is not None:
        result["gpu_growth_mib"] = last["gpu_mib"] - first["gpu_mib"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny", help="bench/shapes.py shape (tiny: CPU)")
    p.add_argument("--transport", choices=["distributed", "disk", "tensor"], default="distributed")
    p.add_argument("--syncs", type=int, default=500)
    p.add_argument("--every", type=int, default=10, help="syncs between two memory samples")
    p.add_argument("--warmup", type=int, default=50, help="syncs before the verdict's first sample")
    p.add_argument(
        "--generate",
        type=int,
        default=0,
        metavar="N",
        help="between two syncs, also generate N one-token samples of the model's prompts (as a rollout asks)",
    )
    p.add_argument(
        "--no-sync",
        action="store_true",
        help="the control: the same loop without the syncs (with --generate: does generating alone grow memory?)",
    )
    p.add_argument(
        "--engine-env",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the engine, e.g. allocator settings to compare (MALLOC_ARENA_MAX=2)",
    )
    p.add_argument("--out", default=None)
    p.add_argument(
        "extra", nargs="*", help="more vime flags, after --, e.g. -- --vllm-num-gpu-blocks-override 2048"
    )
    opts = p.parse_args()
    engine_env = env_entries(p, "--engine-env", opts.engine_env)
    if opts.syncs < opts.warmup + opts.every:
        p.error(
            f"--syncs {opts.syncs}: needs at least --warmup + --every ({opts.warmup + opts.every}) for a verdict"
        )

    from vime.backends.fsdp_utils.trainer import FSDPTrainer
    from vime.backends.vllm_utils.engine import VLLMEngine
    from vime.backends.vllm_utils.weight_sync import make_transport, sync_weights
    from vime.utils.arguments import parse_args
    from vime.utils.distributed import init_distributed

    init_distributed()
    gpu = torch.cuda.is_available()
    if opts.transport == "tensor" and not gpu:
        p.error("--transport tensor (CUDA IPC) needs a GPU")
    model_dir = build_shape(opts.shape, dtype="bfloat16" if gpu else "float32")
    work = Path(tempfile.mkdtemp(prefix="vime-soak-"))
    argv = [
        "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl",
        "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--update-weight-transport", opts.transport, "--update-weight-dir", str(work / "weights"),
        "--vllm-enforce-eager", "--vllm-max-model-len", "256",
        *(["--bf16", "--vllm-gpu-memory-utilization", "0.3"] if gpu else ["--vllm-dtype", "float32"]),
        *(["--colocate"] if opts.transport == "tensor" else []),
        *opts.extra,
    ]  # fmt: skip
    args = parse_args(argv)
    trainer = FSDPTrainer(args)
    engine = VLLMEngine(args, log_path=work / "engine.log", extra_args=EXTENSION, env=engine_env)
    generator = torch.Generator(device="cuda" if gpu else "cpu").manual_seed(0)
    built: list[torch.Tensor] = []
    samples: list[dict] = []
    name = (
        f"sync_soak_{opts.shape}_{opts.transport}_{'gpu' if gpu else 'cpu'}"
        + (f"_generate{opts.generate}" if opts.generate else "")
        + ("_no-sync" if opts.no_sync else "")
    )
    me = psutil.Process()
    prompts = [json.loads(line)["prompt"] for line in (model_dir / "train.jsonl").read_text().splitlines()]
    started = time.monotonic()
    try:
        engine.start().wait_ready_sync()
        for sync in range(1, opts.syncs + 1):
            perturb(trainer.model, generator, built)
            transport = make_transport(args, [engine.url], str(work / "weights"), 0)
            buckets = trainer.iter_weight_buckets(
                args.update_weight_buffer_size, stack_experts=transport.stacks_experts
            )
            if not opts.no_sync:
                sync_weights([engine.url], buckets, transport, sync)
            if opts.generate:
                generate(engine.url, str(model_dir), prompts, opts.generate)
            if sync % opts.every == 0:
                sample = {
                    "syncs": sync,
                    "elapsed_s": time.monotonic() - started,
                    "engine": process_memory(engine.live_processes()),
                    "trainer_pss_mib": me.memory_full_info().pss / MIB,
                    "gpu_mib": gpu_memory_mib(),
                }
                samples.append(sample)
                print(
                    f"[bench] sync {sync}: engine group USS {sample['engine']['uss_mib']:.1f} MiB, PSS "
                    f"{sample['engine']['pss_mib']:.1f} MiB, summed RSS {sample['engine']['rss_mib']:.1f} MiB; "
                    f"trainer PSS {sample['trainer_pss_mib']:.1f} MiB"
                    + (f"; GPU {sample['gpu_mib']:.0f} MiB" if gpu else ""),
                    flush=True,
                )
                write_summary(opts, name, samples)
    finally:
        engine.stop()


def write_summary(opts: argparse.Namespace, name: str, samples: list[dict]) -> None:
    """The benchmark's JSON with every sample so far and the verdict once it has one."""
    found = verdict(samples, opts.warmup)
    summary = (
        f"{name}: engine group USS {found['engine_uss_growth_mib']:+.1f} MiB ({found['engine_uss_growth_pct']:+.2f} %, "
        f"{found['engine_uss_growth_kib_per_sync']:+.1f} KiB per sync), PSS {found['engine_pss_growth_mib']:+.1f} MiB "
        f"from sync {found['from_sync']} to {found['to_sync']}"
        if found
        else f"{name}: {samples[-1]['syncs']} syncs, no verdict before sync {opts.warmup}"
    )
    write_result(
        opts.out or f"bench/results/{name}.json",
        {
            "benchmark": "sync_soak",
            "workload": {
                "shape": opts.shape,
                "transport": opts.transport,
                "syncs": opts.syncs,
                "every": opts.every,
                "warmup": opts.warmup,
                "generate": opts.generate,
                "no_sync": opts.no_sync,
                "engine_env": opts.engine_env,
                "extra": opts.extra,
            },
            "verdict": found,
            "samples": samples,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    main()
