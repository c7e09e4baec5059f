"""Rollout throughput: vLLM's offline ``LLM.generate`` vs vime's rollout path, same prompts and lengths.

(a) offline: one ``vllm.LLM`` in this process, all prompts in one ``generate`` call.
(b) vime: a real vLLM server behind vllm-router, vime's asyncio rollout (token-in/out HTTP, per-sample seeds,
    rewards, grouping). Responses have a fixed length (``ignore_eos``) so both sides generate the same tokens.
Each side gets one warm-up batch, then ``--repeats`` timed batches; the median is reported.

    python bench/rollout_throughput.py --out bench/results/rollout_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


async def fixed_length_generate(args, sample, sampling_params):
    """The default generate with EOS ignored, so every response has exactly max_tokens tokens."""
    from vime.rollout.vllm_rollout import generate

    sampling_params["ignore_eos"] = True
    return await generate(args, sample, sampling_params)


def vime_args(model_dir: Path, log_dir: Path, prompts: int, n: int, length: int):
    from vime.utils.arguments import parse_args

    return parse_args(
        [
            "--train-backend", "fsdp", "--debug-rollout-only",
            "--hf-checkpoint", str(model_dir), "--prompt-data", str(model_dir / "train.jsonl"),
            "--rollout-batch-size", str(prompts), "--n-samples-per-prompt", str(n),
            "--rollout-max-response-len", str(length), "--rm-type", "exact", "--num-rollout", "1",
            "--custom-generate-function-path", "__main__.fixed_length_generate",
            "--vllm-enforce-eager", "--vllm-dtype", "float32", "--vllm-max-model-len", str(length + 32),
            "--log-dir", str(log_dir),
        ]
    )  # fmt: skip


def bench_offline(
    model_dir: Path, prompt_ids: list[list[int]], n: int, length: int, repeats: int
) -> list[float]:
    from vllm import LLM, SamplingParams

    llm = LLM(str(model_dir), enforce_eager=True, dtype="float32", max_model_len=length + 32, seed=0)
    params = SamplingParams(n=n, max_tokens=length, ignore_eos=True, temperature=1.0)
    inputs = [{"prompt_token_ids": ids} for ids in prompt_ids]
    rates = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        if i:  # the first batch is warm-up
            rates.append(tokens / elapsed)
    del llm
    return rates


def bench_vime(args, log_dir: Path, repeats: int) -> list[float]:
    from vime.rollout.rollout_manager import RolloutManager

    manager = RolloutManager(args, log_dir)
    rates = []
    try:
        manager.start()
        for i in range(repeats + 1):
            started = time.perf_counter()
            output = manager.generate(i)
            elapsed = time.perf_counter() - started
            tokens = sum(s.response_length for g in output.samples for s in g)
            if i:
                rates.append(tokens / elapsed)
    finally:
        manager.shutdown()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n-samples", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results/rollout_throughput.json")
    opts = parser.parse_args()

    from vime.tools.make_tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="vime-bench-"))
    model_dir = build_tiny_model(work / "model", seed=0)
    args = vime_args(model_dir, work / "logs", opts.prompts, opts.n_samples, opts.response_len)
    from transformers import AutoTokenizer

    from vime.rollout.data_source import RolloutDataSource

    source = RolloutDataSource(args, AutoTokenizer.from_pretrained(model_dir))
    prompt_ids = [group[0].tokens for group in source.get_samples(opts.prompts)]

    offline = bench_offline(model_dir, prompt_ids, opts.n_samples, opts.response_len, opts.repeats)
    via_vime = bench_vime(args, work / "logs", opts.repeats)
    result = {
        "workload": {
            "model": "tiny Qwen3 (2 layers, hidden 128, fp32)",
            "prompts": opts.prompts,
            "n_samples_per_prompt": opts.n_samples,
            "response_len": opts.response_len,
            "device": "cpu",
            "cpu_count": os.cpu_count(),
        },
        "offline_llm_generate_tok_per_s": statistics.median(offline),
        "vime_rollout_tok_per_s": statistics.median(via_vime),
        "ratio_vime_over_offline": statistics.median(via_vime) / statistics.median(offline),
        "runs": {"offline": offline, "vime": via_vime},
    }
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":  # vLLM's offline engine spawns processes
    sys.exit(main())
