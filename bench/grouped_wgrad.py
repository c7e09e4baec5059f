"""The experts' weight gradient added into Megatron's fp32 ``main_grad``, at Qwen3-30B-A3B's expert shapes: torch's
two passes (``grouped_mm`` to a bf16 ``[E, out, in]`` gradient, then a mixed-dtype ``add_``) against
:mod:`vime.utils.grouped_wgrad`'s one Triton kernel, on one GPU.

Both projections of one layer (``linear_fc1`` ``[128, 1536, 2048]``, ``linear_fc2`` ``[128, 2048, 768]``) for one
8,192-token micro-batch routed top-8 by a random router (65,536 expert rows). Each round times ``--calls`` calls of
each side with CUDA events, the sides in turn (rotated per round); the ratio is the median (min-max) of the
per-round ratios. ``--configs`` adds kernel settings (``BMxBNxBK:warps:stages``) to compare. The two sides' sums
are compared too (relative max difference).

    bash bench/run.sh bench/grouped_wgrad.py                     # 5 rounds
    bash bench/run.sh bench/grouped_wgrad.py --configs 128x128x64:8:3 128x256x64:8:3 256x128x64:8:3 64x128x64:4:4
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH

from bench.shapes import write_result  # noqa: E402
from vime.backends.megatron_utils.grouped_linear import grouped_mm  # noqa: E402
from vime.utils import grouped_wgrad  # noqa: E402

EXPERTS, HIDDEN, FFN, TOP_K = 128, 2048, 768, 8
PROJECTIONS = {"fc1": (2 * FFN, HIDDEN), "fc2": (HIDDEN, FFN)}  # (out, in) of each expert's weight


def parse_config(text: str) -> dict[str, int]:
    blocks, warps, stages = text.split(":")
    block_m, block_n, block_k = (int(b) for b in blocks.split("x"))
    return dict(
        block_m=block_m, block_n=block_n, block_k=block_k, num_warps=int(warps), num_stages=int(stages)
    )


def kernel_default_config() -> str:
    """``add_weight_grads``'s own default settings, as ``--configs`` writes them."""
    d = {k: v.default for k, v in inspect.signature(grouped_wgrad.add_weight_grads).parameters.items()}
    return f"{d['block_m']}x{d['block_n']}x{d['block_k']}:{d['num_warps']}:{d['num_stages']}"


def routed_offsets(tokens: int, generator: torch.Generator) -> torch.Tensor:
    """int32 cumulative rows per expert of ``tokens`` routed top-``TOP_K`` by random router logits."""
    chosen = torch.randn(tokens, EXPERTS, generator=generator).topk(TOP_K, dim=1).indices
    return torch.bincount(chosen.flatten(), minlength=EXPERTS).cumsum(0).to(torch.int32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the micro-batch (rows: x top-8)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=10, help="calls of each side timed per round")
    p.add_argument(
        "--configs",
        nargs="*",
        default=[kernel_default_config()],
        help="kernel settings BMxBNxBK:warps:stages (default: the kernel's)",
    )
    p.add_argument("--out", default="bench/results/grouped_wgrad_30b-a3b.json")
    opts = p.parse_args()
    g = torch.Generator().manual_seed(0)
    offs = routed_offsets(opts.tokens, g).cuda()
    rows = int(offs[-1])
    data = {
        name: (torch.randn(rows, n_out, generator=g).bfloat16().cuda(), torch.randn(rows, n_in, generator=g).bfloat16().cuda())
        for name, (n_out, n_in) in PROJECTIONS.items()
    }  # fmt: skip
    main_grads = {
        name: torch.zeros(EXPERTS, n_out, n_in, device="cuda") for name, (n_out, n_in) in PROJECTIONS.items()
    }

    def torch_side() -> None:
        for name, (grad_out, x) in data.items():
            main_grads[name].add_(grouped_mm(grad_out.t(), x, offs=offs))

    def kernel_side(config: dict[str, int]):
        def run() -> None:
            for name, (grad_out, x) in data.items():
                grouped_wgrad.add_weight_grads(grad_out, x, offs, main_grads[name], **config)

        return run

    sides = {"torch": torch_side} | {f"triton {c}": kernel_side(parse_config(c)) for c in opts.configs}
    agreement = {}
    for label, side in list(sides.items()):  # warm-up (compiles), and each side's sum of one call from zero
        for grad in main_grads.values():
            grad.zero_()
        try:
            side()
            torch.cuda.synchronize()
        except Exception as error:  # a kernel setting this GPU cannot run (shared memory): reported, left out
            print(f"[bench] {label} left out: {type(error).__name__}: {error}", flush=True)
            del sides[label]
            continue
        agreement[label] = {name: grad.clone() for name, grad in main_grads.items()}
    if len(sides) == 1:
        raise SystemExit("no kernel setting ran on this GPU (see the lines above)")
    reference = agreement["torch"]
    differences = {
        label: max(float((sums[n] - reference[n]).abs().max() / reference[n].abs().max()) for n in sums)
        for label, sums in agreement.items()
    }
    del agreement, reference
    ms: dict[str, list[float]] = {label: [] for label in sides}
    labels = list(sides)
    for round_index in range(opts.rounds):
        for label in labels[round_index % len(labels) :] + labels[: round_index % len(labels)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(opts.calls):
                sides[label]()
            end.record()
            end.synchronize()
            ms[label].append(start.elapsed_time(end) / opts.calls)
        print(
            f"[bench] round {round_index + 1}: " + ", ".join(f"{k} {v[-1]:.3f} ms" for k, v in ms.items()),
            flush=True,
        )
    results = {}
    for label in labels:
        ratios = [t / b for t, b in zip(ms[label], ms["torch"], strict=True)]
        results[label] = {
            "ms_per_layer_median": statistics.median(ms[label]),
            "ms_per_layer_range": [min(ms[label]), max(ms[label])],
            "vs_torch_median": statistics.median(ratios),
            "vs_torch_range": [min(ratios), max(ratios)],
            "max_relative_difference_vs_torch": differences[label],
        }
    best = min(labels[1:], key=lambda k: results[k]["vs_torch_median"])
    b = results[best]
    summary = (
        f"expert weight gradients into main_grad, 30B-A3B layer, {rows} rows: torch "
        f"{results['torch']['ms_per_layer_median']:.3f} ms, {best} {b['ms_per_layer_median']:.3f} ms = "
        f"{b['vs_torch_median']:.2f} x ({b['vs_torch_range'][0]:.2f}-{b['vs_torch_range'][1]:.2f}), "
        f"relative difference {b['max_relative_difference_vs_torch']:.1e}"
    )
    workload = {"experts": EXPERTS, "projections": PROJECTIONS, "tokens": opts.tokens, "rows": rows}
    write_result(opts.out, {"benchmark": "grouped_wgrad", "workload": workload, "rounds": opts.rounds,
                            "calls_per_round": opts.calls, "sides": results, "summary": summary})  # fmt: skip


if __name__ == "__main__":
    main()
