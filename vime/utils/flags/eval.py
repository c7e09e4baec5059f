"""Evaluation flags.

Each group is a list of ``(flag, add_argument kwargs)``; ``vime.utils.arguments`` builds the parser."""

from __future__ import annotations

EVAL = [
    (
        "--eval-function-path",
        dict(default=None, help="Eval function (default: --rollout-function-path with evaluation=True)."),
    ),
    ("--eval-interval", dict(type=int, default=None, help="Evaluate every N rollouts.")),
    (
        "--eval-prompt-data",
        dict(nargs="+", default=None, metavar="NAME PATH", help="Eval datasets as name/path pairs."),
    ),
    ("--eval-config", dict(default=None, help="YAML with per-dataset eval settings.")),
    ("--n-samples-per-eval-prompt", dict(type=int, default=1, help="Samples per eval prompt.")),
    (
        "--eval-max-response-len",
        dict(type=int, default=None, help="Eval max new tokens (default: rollout's)."),
    ),
    ("--eval-temperature", dict(type=float, default=None, help="Eval temperature (default: rollout's).")),
    ("--eval-top-p", dict(type=float, default=None, help="Eval top-p (default: rollout's).")),
    ("--eval-top-k", dict(type=int, default=None, help="Eval top-k (default: rollout's).")),
    ("--eval-min-new-tokens", dict(type=int, default=0, help="Eval min new tokens per response.")),
    ("--eval-input-key", dict(default=None, help="Eval prompt field (default: --input-key).")),
    ("--eval-label-key", dict(default=None, help="Eval label field (default: --label-key).")),
    ("--eval-tool-key", dict(default=None, help="Eval tools field (default: --tool-key).")),
    (
        "--eval-max-prompt-len",
        dict(type=int, default=None, help="Drop eval prompts longer than this many tokens (logged)."),
    ),
    (
        "--eval-max-context-len",
        dict(
            type=int,
            default=None,
            help="Eval prompt + response token cap (default: --rollout-max-context-len).",
        ),
    ),
    ("--skip-eval-before-train", dict(action="store_true", help="No eval before the first training step.")),
    (
        "--start-rollout-id",
        dict(
            type=int, default=None, help="First rollout step (default: after the loaded checkpoint, else 0)."
        ),
    ),
]
