"""HF <-> ``torch_dist`` conversion (``tools/convert_hf_to_torch_dist.py``, ``tools/convert_torch_dist_to_hf.py``).

Run in one process (one GPU) or under ``torchrun`` with ``--tensor-model-parallel-size`` etc.; the model
flags default to what ``--hf-checkpoint``'s ``config.json`` implies, and given flags override them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from vime.backends.megatron_utils.hf_config import flags_from_hf_config, flags_to_argv, load_hf_config
from vime.utils.checkpoint_layout import mark_latest
from vime.utils.megatron_args import add_megatron_arguments


def parse(argv: Sequence[str] | None, to_hf: bool) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="torch_dist -> HF" if to_hf else "HF -> torch_dist (iteration 0, model only)"
    )
    parser.add_argument(
        "--hf-checkpoint", required=True, help="HF dir: weights (HF -> torch_dist) or config/tokenizer."
    )
    if to_hf:
        parser.add_argument("--output-dir", required=True, help="HF directory to write.")
        parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    add_megatron_arguments(parser)
    parser.set_defaults(
        transformer_impl="local"
    )  # vime builds Megatron-Core's local layers (no TransformerEngine)
    argv = list(sys.argv[1:] if argv is None else argv)
    first = parser.parse_args(argv)
    implied = flags_to_argv(flags_from_hf_config(load_hf_config(first.hf_checkpoint)))
    return parser.parse_args(implied + argv)  # given flags come last, so they win


def _module(args: argparse.Namespace):
    from vime.backends.megatron_utils.hf_config import check_hf_config
    from vime.backends.megatron_utils.model import build_gpt_model
    from vime.backends.megatron_utils.trainer import init_megatron_parallel

    init_megatron_parallel(args)
    config = load_hf_config(args.hf_checkpoint)
    check_hf_config(args, config)
    return build_gpt_model(args, config["vocab_size"]), config["vocab_size"]


def hf_to_torch_dist(argv: Sequence[str] | None = None) -> None:
    """``--hf-checkpoint HF --save DIR``: write ``DIR/iter_0000000`` and ``latest_checkpointed_iteration.txt``."""
    from vime.backends.megatron_utils import checkpoint, weights

    args = parse(argv, to_hf=False)
    if not args.save:
        raise SystemExit("--save DIR is required")
    module, vocab = _module(args)
    weights.load_hf_weights(module, args.hf_checkpoint, vocab)
    checkpoint.save(args.save, 0, module, None, None, 0)
    if torch.distributed.get_rank() == 0:
        mark_latest(args.save, 0)


def torch_dist_to_hf(argv: Sequence[str] | None = None) -> None:
    """``--load DIR [--ckpt-step N] --hf-checkpoint HF --output-dir OUT``: the model as an HF directory."""
    from vime.backends.megatron_utils import checkpoint

    args = parse(argv, to_hf=True)
    if not args.load:
        raise SystemExit("--load DIR is required")
    module, vocab = _module(args)
    checkpoint.load(args.load, args.ckpt_step, module, None, None, load_rng=False)
    checkpoint.export_hf(module, args.output_dir, args.hf_checkpoint, vocab, getattr(torch, args.dtype))
