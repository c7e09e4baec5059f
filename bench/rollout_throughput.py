"""Rollout throughput: vime's rollout path against the same vLLM engine driven offline and over HTTP directly.

Three ways to generate the same prompts (``--prompts`` groups of ``--n-samples``), with fixed-length responses
(EOS ignored) and the sampled-token log-probs RL needs, one after the other on the same machine:

(a) offline: ``vllm.LLM.generate`` in this process, all prompts in one call (``--offline-without-logprobs``: also
    without log-probs, for reference);
(b) direct: a vLLM server as vime launches it, driven by a bare asyncio client (one ``n``-sample request per
    group, ``--rollout-concurrency`` requests in flight), no router, no vime; then the same client through
    vllm-router (what the router costs);
(c) vime: the same server behind vllm-router, through vime's rollout (``RolloutManager.generate`` with the default
    rollout, EOS ignored by ``bench/fixed_length.py``: groups, per-sample status and log-probs, rewards, the buffer);
    ``--sample-seeds``: also with ``--rollout-sample-seeds`` (what per-request seeds cost).

Each side gets one warm-up batch, then ``--repeats`` timed batches; medians are reported. CPU (tiny model):

    python bench/rollout_throughput.py
GPU (a shape from bench/shapes.py, bf16; CUDA graphs unless --enforce-eager):

    python bench/rollout_throughput.py --shape 0.6b --prompts 256 --n-samples 8 --response-len 256 --enforce-eager
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # this process may have touched CUDA


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def engine_flags(opts) -> dict:
    """The engine settings both (a) and (b)/(c) use."""
    flags = {
        "dtype": opts.dtype,
        "max_model_len": opts.response_len + 64,
        "enforce_eager": opts.enforce_eager,
    }
    if on_gpu():
        flags["gpu_memory_utilization"] = opts.gpu_memory_utilization
    return flags


def vime_args(opts, model_dir: Path, log_dir: Path, extra: list[str] | None = None):
    from vime.utils.arguments import parse_args

    flags = engine_flags(opts)
    argv = [
        "--train-backend", "fsdp", "--debug-rollout-only",
        "--hf-checkpoint", str(model_dir), "--prompt-data", str(model_dir / "train.jsonl"),
        "--rollout-batch-size", str(opts.prompts), "--n-samples-per-prompt", str(opts.n_samples),
        "--rollout-max-response-len", str(opts.response_len), "--rm-type", "exact", "--num-rollout", "1",
        "--vllm-dtype", flags["dtype"], "--vllm-max-model-len", str(flags["max_model_len"]),
        "--log-dir", str(log_dir), "--rollout-function-path", "bench.fixed_length.generate_rollout",
    ]  # fmt: skip
    if opts.concurrency:
        argv += ["--rollout-concurrency", str(opts.concurrency)]
    if opts.enforce_eager:
        argv += ["--vllm-enforce-eager"]
    if "gpu_memory_utilization" in flags:
        argv += ["--vllm-gpu-memory-utilization", str(flags["gpu_memory_utilization"])]
    return parse_args(argv + (extra or []))


def bench_offline(opts, model_dir: Path, prompt_ids: list[list[int]], logprobs: int | None) -> list[float]:
    from vllm import LLM, SamplingParams

    llm = LLM(str(model_dir), seed=0, **engine_flags(opts))
    params = SamplingParams(
        n=opts.n_samples, max_tokens=opts.response_len, ignore_eos=True, temperature=1.0, logprobs=logprobs
    )
    inputs = [{"prompt_token_ids": ids} for ids in prompt_ids]
    rates = []
    for i in range(opts.repeats + 1):
        started = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        if i:  # the first batch is warm-up
            rates.append(tokens / elapsed)
    llm.llm_engine.engine_core.shutdown()
    del llm
    return rates


async def drive_directly(url: str, model: str, prompt_ids: list[list[int]], opts) -> float:
    """Generated tokens/s of one batch sent straight to the engine by a bare aiohttp client."""
    started = time.perf_counter()
    tokens = await send_completions(url, model, prompt_ids, opts)
    return tokens / (time.perf_counter() - started)


async def post_all(url: str, payloads: list[dict], concurrency: int) -> list[dict]:
    """POST every payload to ``url`` from a bare aiohttp client, ``concurrency`` at a time; the JSON answers (any
    other status than 200 raises)."""
    import aiohttp

    limit = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(payload: dict) -> dict:
            async with limit, session.post(url, json=payload) as response:
                body = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"{url} answered {response.status}: {body}")
            return body

        return await asyncio.gather(*(one(payload) for payload in payloads))


async def send_completions(url: str, model: str, prompt_ids: list[list[int]], opts) -> int:
    """Generated tokens of one batch of ``/v1/completions`` requests as vime sends them (one ``n``-sample request
    per group, sampled-token log-probs, token ids in and out), from a bare aiohttp client."""
    payloads = [
        {
            "model": model,
            "prompt": ids,
            "n": opts.n_samples,
            "max_tokens": opts.response_len,
            "ignore_eos": True,
            "temperature": 1.0,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }  # fmt: skip
        for ids in prompt_ids
    ]
    bodies = await post_all(f"{url}/v1/completions", payloads, opts.concurrency or 512)
    return sum(len(choice["token_ids"]) for body in bodies for choice in body["choices"])


def bench_served(args, prompt_ids: list[list[int]], opts, log_dir: Path) -> dict[str, list[float]]:
    """Rates of each side against one server: the bare client to the engine and through the router, then vime's
    rollout (and with ``--sample-seeds`` vime's rollout with per-request seeds)."""
    from vime.rollout.rollout_manager import RolloutManager
    from vime.utils.async_utils import run

    manager = RolloutManager(args, log_dir)
    rates: dict[str, list[float]] = {}

    def timed(side: str, batch: Callable[[int], float]) -> None:
        rates[side] = [batch(i) for i in range(opts.repeats + 1)][1:]  # the first batch is warm-up

    def vime_batch(i: int) -> float:
        started = time.perf_counter()
        output = manager.generate(i)
        elapsed = time.perf_counter() - started
        return sum(s.response_length for g in output.samples for s in g) / elapsed

    try:
        manager.start()
        model = args.hf_checkpoint
        engine_url, router_url = manager.engines[0].url, manager.run_context.router_url
        timed("direct", lambda i: run(drive_directly(engine_url, model, prompt_ids, opts)))
        timed("direct_via_router", lambda i: run(drive_directly(router_url, model, prompt_ids, opts)))
        timed("vime", vime_batch)
        if opts.sample_seeds:
            args.rollout_sample_seeds = True
            timed("vime_sample_seeds", vime_batch)
    finally:
        manager.shutdown()
    return rates


def workload_parser(doc: str, repeats: int) -> argparse.ArgumentParser:
    """The flags every rollout-side benchmark shares: model shape, prompts and samples, response length, repeats,
    concurrency and engine settings."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shape", default="tiny", help="tiny (CPU, fp32) or a bench/shapes.py shape (GPU, bf16)"
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n-samples", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument(
        "--concurrency", type=int, default=None, help="--rollout-concurrency (default: vime's)"
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (always on CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    return parser


def prepare_workload(opts, extra_vime_flags: list[str] | None = None):
    """Settle ``opts`` for this machine (GPU: bf16 and the shape; CPU: the fp32 tiny model, eager) and build the
    model; returns its directory, vime's parsed args for it and the prompts' token ids."""
    from transformers import AutoTokenizer

    from bench.shapes import build_shape
    from vime.rollout.data_source import RolloutDataSource
    from vime.tools.make_tiny_model import build_tiny_model

    gpu = on_gpu()
    opts.dtype = "bfloat16" if gpu else "float32"
    opts.enforce_eager = opts.enforce_eager or not gpu
    work = Path(tempfile.mkdtemp(prefix="vime-bench-"))
    model_dir = build_shape(opts.shape) if gpu else build_tiny_model(work / "model", seed=0)
    args = vime_args(opts, model_dir, work / "logs", extra_vime_flags)
    source = RolloutDataSource(args, AutoTokenizer.from_pretrained(model_dir))
    return model_dir, args, [group[0].tokens for group in source.get_samples(opts.prompts)]


def workload_record(opts, benchmark: str) -> tuple[str, dict]:
    """The result's name (``<benchmark>_<shape>_<eager|cuda-graphs>_<prompts>x<n>x<len>``) and its workload."""
    graphs = "eager" if opts.enforce_eager else "cuda-graphs"
    name = f"{benchmark}_{opts.shape}_{graphs}_{opts.prompts}x{opts.n_samples}x{opts.response_len}"
    workload = {
        "shape": opts.shape, "dtype": opts.dtype, "cuda_graphs": not opts.enforce_eager, "prompts": opts.prompts,
        "n_samples_per_prompt": opts.n_samples, "response_len": opts.response_len, "repeats": opts.repeats,
    }  # fmt: skip
    return name, workload


def main() -> None:
    from bench.shapes import write_result

    parser = workload_parser(__doc__, repeats=3)
    parser.add_argument(
        "--offline-without-logprobs", action="store_true", help="also time offline without log-probs"
    )
    parser.add_argument(
        "--sample-seeds", action="store_true", help="also time vime with --rollout-sample-seeds (GPU only)"
    )
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    model_dir, args, prompt_ids = prepare_workload(opts)

    offline = bench_offline(opts, model_dir, prompt_ids, logprobs=0)
    offline_no_logprobs = (
        bench_offline(opts, model_dir, prompt_ids, logprobs=None) if opts.offline_without_logprobs else []
    )
    served = bench_served(args, prompt_ids, opts, Path(args.log_dir))
    med = {side: statistics.median(rates) for side, rates in {"offline": offline, **served}.items()}
    name, workload = workload_record(opts, "rollout")
    write_result(
        opts.out or f"bench/results/{name}.json",
        {
            "benchmark": "rollout_throughput",
            "workload": workload
            | {
                "rollout_concurrency": args.rollout_concurrency,
                "log_probs": "sampled token (logprobs=0) on every side",
            },
            "offline_tok_per_s": med["offline"],
            "offline_without_logprobs_tok_per_s": statistics.median(offline_no_logprobs or [0.0]),
            "direct_http_tok_per_s": med["direct"],
            "direct_http_via_router_tok_per_s": med["direct_via_router"],
            "vime_tok_per_s": med["vime"],
            "vime_sample_seeds_tok_per_s": med.get("vime_sample_seeds", 0.0),
            "ratio_vime_over_offline": med["vime"] / med["offline"],
            "ratio_vime_over_direct": med["vime"] / med["direct"],
            "runs": {"offline": offline, "offline_no_logprobs": offline_no_logprobs, **served},
            "summary": f"{name}: vime {med['vime']:,.0f} tok/s = {med['vime'] / med['offline']:.2f} x offline "
            f"({med['offline']:,.0f}), {med['vime'] / med['direct']:.2f} x direct HTTP ({med['direct']:,.0f}; via the "
            f"router {med['direct_via_router']:,.0f})"
            + (f"; with --rollout-sample-seeds {med['vime_sample_seeds']:,.0f}" if opts.sample_seeds else ""),
        },
    )


if __name__ == "__main__":  # vLLM's offline engine spawns processes
    sys.exit(main())
