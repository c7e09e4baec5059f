"""CPU quick start (interim): tiny model + task, vime's config and data path, real vLLM sampling, rewards.

What runs today: build the tiny Qwen3 + the "n+3=" task offline, parse the quick-start GRPO configuration
with vime's argument system, load the prompts, sample N responses per prompt from a real vLLM engine and
score them with vime's reward hub -- the untrained baseline the GRPO run will start from.
Not there yet: the training loop (Ray, FSDP2 trainer, weight sync, train.py) is tracked in the loop issue;
until it lands this script stops after the baseline and says so.
"""

from __future__ import annotations

import asyncio
import copy
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # FACTS.md: always size the KV cache on CPU
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

RUN_DIR = Path(os.environ.get("VIME_QUICKSTART_DIR", "runs/quickstart"))


def quickstart_argv(model_dir: Path) -> list[str]:
    """The GRPO configuration the quick start runs (validated now, trained once the loop lands)."""
    return [
        "--train-backend",
        "fsdp",
        "--hf-checkpoint",
        str(model_dir),
        "--prompt-data",
        str(model_dir / "train.jsonl"),
        "--eval-prompt-data",
        "add3",
        str(model_dir / "eval.jsonl"),
        "--rm-type",
        "exact",
        "--rollout-batch-size",
        "16",
        "--n-samples-per-prompt",
        "8",
        "--rollout-max-response-len",
        "2",
        "--rollout-temperature",
        "1.0",
        "--num-rollout",
        "60",
        "--lr",
        "3e-3",
        "--advantage-estimator",
        "grpo",
        "--vllm-enforce-eager",
        "--vllm-dtype",
        "float32",
        "--vllm-max-model-len",
        "64",
    ]


def main() -> None:
    from vllm import LLM, SamplingParams

    from vime.rollout.rm_hub import reward_samples
    from vime.tools.make_tiny_model import build_tiny_model
    from vime.utils.arguments import parse_args
    from vime.utils.data import load_prompt_dataset

    started = time.time()
    model_dir = build_tiny_model(RUN_DIR / "model", seed=0)
    print(f"[quickstart] tiny model, tokenizer and task written to {model_dir}")
    args = parse_args(quickstart_argv(model_dir))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = load_prompt_dataset(
        args.prompt_data, tokenizer, input_key=args.input_key, label_key=args.label_key
    )
    prompts = [
        data.samples[i]
        for i in data.epoch_order(0, args.rollout_seed, shuffle=True)[: args.rollout_batch_size]
    ]
    print(
        f"[quickstart] {len(data)} prompts loaded; sampling {len(prompts)} x {args.n_samples_per_prompt} with vLLM"
    )
    llm = LLM(str(model_dir), enforce_eager=True, dtype="float32", max_model_len=64, seed=args.rollout_seed)
    params = SamplingParams(
        n=args.n_samples_per_prompt,
        temperature=args.rollout_temperature,
        max_tokens=args.rollout_max_response_len,
    )
    outputs = llm.generate([{"prompt_token_ids": s.tokens} for s in prompts], params)
    samples = []
    for prompt, output in zip(prompts, outputs, strict=True):
        for completion in output.outputs:
            sample = copy.deepcopy(prompt)
            sample.response = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            samples.append(sample)
    failures = asyncio.run(reward_samples(args, samples))
    mean_reward = sum(s.reward for s in samples) / len(samples)
    print(
        f"[quickstart] baseline mean reward (random-init model): {mean_reward:.3f} over {len(samples)} samples, "
        f"{failures} reward failures, {time.time() - started:.0f}s"
    )
    print(
        "[quickstart] NOT THERE YET: GRPO training (Ray + FSDP2 trainer + weight sync + train.py) lands with the "
        "loop issue; this run stops at the untrained baseline."
    )


if __name__ == "__main__":  # vLLM's offline engine spawns processes (FACTS.md)
    sys.exit(main())
