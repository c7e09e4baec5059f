"""Checkpoint and weight-sync flags.

Each group is a list of ``(flag, add_argument kwargs)``; ``vime.utils.arguments`` builds the parser."""

from __future__ import annotations

import argparse

CHECKPOINT = [
    (
        "--ref-load",
        dict(
            default=None,
            help="Reference model for KL (default --hf-checkpoint); also the fallback for --load.",
        ),
    ),
    (
        "--ref-ckpt-step",
        dict(type=int, default=None, help="Iteration of a checkpoint --ref-load for the reference model."),
    ),
    ("--critic-load", dict(default=None, help="Critic checkpoint to load.")),
    ("--critic-save", dict(default=None, help="Critic checkpoint directory.")),
    (
        "--save-hf",
        dict(default=None, help="Also export HF weights here at each save ({rollout_id} is filled in)."),
    ),
]

SYNC = [
    (
        "--update-weight-transport",
        dict(
            default=None,
            choices=["disk", "distributed", "nccl", "tensor"],
            help="Weight sync transport (default: tensor with --colocate, else distributed; nccl is slime's name "
            "for distributed).",
        ),
    ),
    (
        "--update-weight-mode",
        dict(
            default="full",
            choices=["full", "delta"],
            help="full: every sync sends every weight (delta, slime's SGLang-side diff sync, is refused).",
        ),
    ),
    (
        "--update-weight-disk-dir",
        dict(dest="update_weight_dir", default=None, help="slime's name for --update-weight-dir."),
    ),
    (
        "--update-weight-disk-keep-files",
        dict(
            action="store_true",
            help="disk transport: keep every sync's weights (<dir>/v<version>) instead of deleting them once "
            "the engines have loaded them.",
        ),
    ),
    (
        "--custom-update-weight-post-write-path",
        dict(
            default=None,
            help="disk transport: hook(args, version_dir, engine_urls) on every training rank after the files "
            "are written, before the engines read them (slime).",
        ),
    ),
    (
        "--custom-update-weight-paused-path",
        dict(
            default=None,
            help="hook(args, version, engine_urls) on training rank 0 in every weight sync (any transport), once "
            "every engine it reaches is paused and before the weights move: the engines serve nothing while it "
            "runs (e.g. to record their state, notify a monitor, or hold the sync to inject a fault in a test). "
            "An exception fails the sync; the engines are resumed.",
        ),
    ),
    (
        "--check-weight-update-equal",
        dict(
            action=argparse.BooleanOptionalAction,
            default=None,
            help="On by default (with engines to check): after every weight sync each engine proves it holds the "
            "trainer's weights: its parameters' checksums against those recorded when it loaded them and against "
            "the other engines', and its log-probs of a fixed sequence against the trainer's; a mismatch stops the "
            "run naming the engine and the tensor (vime.utils.weight_check). --no-check-weight-update-equal turns "
            "it off.",
        ),
    ),
    (
        "--update-weight-buffer-size",
        dict(type=int, default=512 * 1024**2, help="Bytes per weight-sync bucket."),
    ),
    ("--update-weight-dir", dict(default=None, help="Shared directory for --update-weight-transport disk.")),
    (
        "--flush-cache-interval",
        dict(
            type=int,
            default=None,
            metavar="N",
            help="In-flight weight updates (upstream vime's flag, after PipelineRL): a sync pauses generation in "
            "place, so a sequence in flight finishes on the new weights, and every sample records which weight "
            "version sampled each of its tokens (weight_version_spans, from vLLM's per-token version labels: "
            "engines run with --enable-scale-out). Sync 1 of a run and, for N > 0, every N-th sync after it "
            "(versions 1, 1+N, 1+2N, ...) is a full refresh instead: in-flight requests are aborted (their groups go "
            "back to the data buffer) and the prefix cache is dropped. N <= 0: no refresh after sync 1; the default "
            "rollout function becomes the fully-async one. Unset (default): syncs pause in place, and a request "
            "spanning one is stamped with the version it was sent at.",
        ),
    ),
]
