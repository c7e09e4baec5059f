"""Cluster flags: nodes, GPUs per role, colocation and offload.

Each group is a list of ``(flag, add_argument kwargs)``; ``vime.utils.arguments`` builds the parser."""

from __future__ import annotations

CLUSTER = [
    (
        "--train-backend",
        dict(
            default="megatron",
            choices=["megatron", "fsdp"],
            help="Training backend (megatron needs CUDA + megatron-core).",
        ),
    ),
    ("--actor-num-nodes", dict(type=int, default=1, help="Nodes for the actor.")),
    (
        "--actor-num-gpus-per-node",
        dict(type=int, default=1, help="Training ranks per node (GPUs, or CPU processes without GPUs)."),
    ),
    ("--critic-num-nodes", dict(type=int, default=None, help="Nodes for the critic (default: as actor).")),
    (
        "--critic-num-gpus-per-node",
        dict(type=int, default=None, help="Ranks per node for the critic (default: as actor)."),
    ),
    (
        "--rollout-num-gpus",
        dict(
            type=int,
            default=None,
            help="GPUs for all vLLM engines (default: actor's with --colocate, else 1).",
        ),
    ),
    (
        "--rollout-num-gpus-per-engine",
        dict(type=int, default=1, help="GPUs per engine (vLLM tensor parallel size)."),
    ),
    (
        "--vllm-config",
        dict(
            default=None,
            help="YAML of the models vLLM serves (slime's --sglang-config): the policy and frozen reference/teacher/"
            "reward models, each with server groups and vLLM flag overrides, each behind its own router "
            "(vime.rollout.vllm_generate.get_model_url). Needs --rollout-num-gpus = all groups' GPUs. (vLLM's own "
            "--config file cannot be passed through; use its flags.)",
        ),
    ),
    (
        "--num-gpus-per-node",
        dict(
            type=int,
            default=8,
            help="GPUs per node: an engine (--rollout-num-gpus-per-engine) fits in one, or spans whole nodes "
            "(vLLM's Ray executor on the engine's bundles; GPU only).",
        ),
    ),
    (
        "--colocate",
        dict(action="store_true", help="Training and rollout share GPUs (engines sleep while training)."),
    ),
    ("--offload", dict(action="store_true", help="Same as --offload-train --offload-rollout.")),
    ("--offload-train", dict(action="store_true", help="Move training state off the GPU during rollout.")),
    ("--offload-rollout", dict(action="store_true", help="Sleep vLLM engines during training.")),
    (
        "--rollout-session-id",
        dict(
            default=None,
            metavar="ID",
            help="Keep the engines serving across a trainer failure (upstream vime's flag): on the Ray cluster at "
            "RAY_ADDRESS the engines and their rollout bundles are detached Ray actors named after ID, so a driver "
            "that fails or is killed leaves them running, and train.py resubmitted with the same ID and engine "
            "flags finds them again, pushes its weights into them before rollout 0 and goes on (resume with "
            "--load). A run that finishes stops them. Not with --colocate, --offload-rollout, "
            "--rollout-external-engine-addrs, --use-fault-tolerance or --debug-train-only.",
        ),
    ),
]
