"""Debugging, tracking and logging flags.

Each group is a list of ``(flag, add_argument kwargs)``; ``vime.utils.arguments`` builds the parser."""

from __future__ import annotations

DEBUG_AND_LOGGING = [
    ("--debug-rollout-only", dict(action="store_true", help="Run rollouts without a trainer.")),
    ("--debug-train-only", dict(action="store_true", help="Train on saved rollouts without engines.")),
    (
        "--save-debug-rollout-data",
        dict(default=None, help="Save each rollout to this path ({rollout_id} is filled in)."),
    ),
    (
        "--load-debug-rollout-data",
        dict(default=None, help="Load rollouts from this path instead of generating."),
    ),
    (
        "--load-debug-rollout-data-subsample",
        dict(
            type=float,
            default=None,
            help="Keep this fraction (0, 1] of the groups of each loaded debug rollout (seeded by --rollout-seed).",
        ),
    ),
    (
        "--load-forge-rollout-data",
        dict(
            default=None,
            help="Replay rollouts from this path ({rollout_id} optional) with engines, weight sync and eval live "
            "(slime; --load-debug-rollout-data turns the engines off).",
        ),
    ),
    (
        "--save-debug-train-data",
        dict(
            default=None,
            help="Save each rank's training inputs (tokens, masks, rewards, log-probs, advantages) to this path "
            "({rollout_id}, {rank} filled in).",
        ),
    ),
    (
        "--dump-details",
        dict(
            default=None,
            help="Directory for everything of a run's data: DIR/rollout_data/{rollout_id}.json, "
            "DIR/train_data/{rollout_id}_{rank}.pt and DIR/tokenizer.",
        ),
    ),
    ("--log-multi-turn", dict(action="store_true", help="Log multi-turn response and round statistics.")),
    (
        "--log-reward-category",
        dict(default=None, help="Log the share of each value of this key of dict rewards (error_cat/*)."),
    ),
    (
        "--log-correct-samples",
        dict(
            action="store_true",
            help="Log length quartiles and entropy of the samples with reward 1 (correct_*).",
        ),
    ),
    (
        "--record-memory-history",
        dict(
            action="store_true",
            help="Record the trainer's CUDA memory history (for PyTorch's memory viz), dumped after "
            "--memory-snapshot-num-steps rollouts and on out-of-memory.",
        ),
    ),
    ("--memory-snapshot-dir", dict(default=".", help="Where memory snapshots are written.")),
    (
        "--memory-snapshot-num-steps",
        dict(type=int, default=None, help="Dump the memory snapshot after this many rollouts."),
    ),
    (
        "--memory-recorder",
        dict(default="torch", choices=["torch", "memray"], help="torch (CUDA) or memray (host memory)."),
    ),
    (
        "--profile-target",
        dict(
            nargs="+",
            default=["train_overall"],
            choices=["train_overall", "train_actor", "train_log_probs"],
            help="What --record-memory-history covers: train_overall (the others need a profiler vime lacks).",
        ),
    ),
    (
        "--ci-test",
        dict(action="store_true", help="Fail the run when a CI check below does not hold (slime)."),
    ),
    (
        "--ci-disable-kl-checker",
        dict(action="store_true", help="--ci-test without the zero-KL checks of the first step."),
    ),
    (
        "--ci-train-rollout-logprob-abs-diff-threshold",
        dict(type=float, default=0.1, help="--ci-test: upper bound of train/train_rollout_logprob_abs_diff."),
    ),
    (
        "--ci-save-grad-norm",
        dict(default=None, help="Save each step's grad norm to this path ({role}, {rollout_id}, {step_id})."),
    ),
    (
        "--ci-load-grad-norm",
        dict(
            default=None,
            help="Fail when a step's grad norm differs from the one saved there by over 1%% and 0.01.",
        ),
    ),
    (
        "--log-dir",
        dict(
            default=None,
            help="Run directory for metrics JSONL and plots (default: <save>/logs or ./runs/<time>).",
        ),
    ),
    ("--use-tensorboard", dict(action="store_true", help="Log to TensorBoard.")),
    ("--use-wandb", dict(action="store_true", help="Log to Weights & Biases.")),
    ("--wandb-mode", dict(default=None, choices=["online", "offline", "disabled"], help="W&B mode.")),
    ("--wandb-group", dict(default=None, help="W&B group.")),
    ("--wandb-team", dict(default=None, help="W&B entity (team or user).")),
    (
        "--wandb-key",
        dict(default=None, help="W&B API key (logs in; the run goes online)."),
    ),
    ("--wandb-host", dict(default=None, help="W&B server URL (self-hosted).")),
    ("--wandb-dir", dict(default=None, help="W&B local directory (same as --wandb-save-dir).")),
    ("--wandb-run-id", dict(default=None, help="W&B run id to create or resume.")),
    (
        "--disable-wandb-random-suffix",
        dict(
            action="store_false",
            dest="wandb_random_suffix",
            help="Use --wandb-exp-name as is (no random suffix).",
        ),
    ),
    (
        "--wandb-always-use-train-step",
        dict(action="store_true", help="W&B step = optimizer steps so far (default: the rollout id)."),
    ),
    ("--tb-project-name", dict(default=None, help="TensorBoard sub-directory (project).")),
    (
        "--tb-experiment-name",
        dict(default=None, help="TensorBoard sub-directory (experiment) inside the project."),
    ),
]
