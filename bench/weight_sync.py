"""Weight-sync throughput: a trainer in this process pushes its bf16 weights into a real vLLM engine, as
``train.py`` does, over each ``--transport`` (GB/s of weights moved, pause to resume), next to the GPU's
device-to-device copy bandwidth measured in the same run. After each sync the engine's log-probs of a fixed
sequence are checked against the trainer's.

    python bench/weight_sync.py --shape 4b --transports tensor disk          # one GPU: the engine beside the trainer
    python bench/weight_sync.py --shape 4b --transports distributed          # two GPUs: the engine on the second
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH

import torch  # noqa: E402

from bench.shapes import build_shape, trainer_flags, write_result  # noqa: E402

EXTENSION = ["--worker-extension-cls", "vime.backends.vllm_utils.worker_extension.VimeWorkerExtension"]
SEQUENCE = [5, 17, 9, 30, 12, 7, 22, 14, 3, 40, 11, 26, 8, 19, 33, 4]


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="4b")
    p.add_argument("--backend", choices=["megatron", "fsdp"], default="megatron")
    p.add_argument("--transports", nargs="+", default=["tensor", "disk"])
    p.add_argument("--buffer-size-mb", type=int, default=1024, help="--update-weight-buffer-size")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs per transport after a warm-up one")
    p.add_argument("--out", default=None)
    opts = p.parse_args()

    from vime.backends.vllm_utils.engine import VLLMEngine
    from vime.backends.vllm_utils.weight_sync import sync_weights_from_trainer
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
        "--num-rollout", "1", "--update-weight-buffer-size", str(opts.buffer_size_mb * 2**20),
        "--vllm-enforce-eager", "--vllm-max-model-len", "256",
        "--vllm-gpu-memory-utilization", "0.8" if split else "0.3",
    ]  # fmt: skip
    args = parse_args(argv + (["--colocate"] if "tensor" in opts.transports else []))
    if opts.backend == "megatron":
        from vime.backends.megatron_utils.trainer import MegatronTrainer as Trainer
    else:
        from vime.backends.fsdp_utils.trainer import FSDPTrainer as Trainer
    trainer = Trainer(args)
    want = trainer.compute_log_probs(
        [Sample(index=0, tokens=SEQUENCE, response_length=len(SEQUENCE) - 1, status=Status.COMPLETED)]
    )[0]
    ceiling = copy_bandwidth_gb_s()
    gpu = "1" if split else os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    engine = VLLMEngine(
        args, log_path=work / "engine.log", extra_args=EXTENSION, env={"CUDA_VISIBLE_DEVICES": gpu}
    )
    results = {}
    try:
        engine.start().wait_ready_sync()
        for transport in opts.transports:
            args.update_weight_transport = transport
            runs = [
                sync_weights_from_trainer(trainer, 0, args, [engine.url], version, str(work / "weights"))
                for version in range(opts.repeats + 1)
            ]
            diff = float((engine_log_probs(engine.url, str(model_dir)) - want).abs().mean())
            rates = [r["weight_sync/gb_per_s"] for r in runs[1:]]
            results[transport] = {
                "gb_per_s": statistics.median(rates),
                "time_s": statistics.median(r["weight_sync/time_s"] for r in runs[1:]),
                "bytes": runs[-1]["weight_sync/bytes"],
                "engine_vs_trainer_logprob_abs_diff": diff,
                "runs": rates,
            }
            print(f"[bench] {transport}: {results[transport]}", flush=True)
    finally:
        engine.stop()
    name = f"weight_sync_{opts.backend}_{opts.shape}_{'2gpu' if split else '1gpu'}"
    summary = ", ".join(f"{t} {r['gb_per_s']:.1f} GB/s ({r['time_s']:.2f} s)" for t, r in results.items())
    write_result(
        opts.out or f"bench/results/{name}.json",
        {
            "benchmark": "weight_sync",
            "workload": {
                "shape": opts.shape,
                "backend": opts.backend,
                "buffer_mb": opts.buffer_size_mb,
                "engine_gpu": "second GPU" if split else "the trainer's GPU",
            },  # fmt: skip
            "device_copy_gb_per_s": ceiling,
            "transports": results,
            "summary": f"{name}: {summary}; device copy {ceiling:.0f} GB/s",
        },
    )


if __name__ == "__main__":
    main()
