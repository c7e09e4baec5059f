"""Rollout flags (sampling, batching, engines' concurrency) and reward flags.

Each group is a list of ``(flag, add_argument kwargs)``; ``vime.utils.arguments`` builds the parser."""

from __future__ import annotations

ROLLOUT = [
    (
        "--rollout-function-path",
        dict(
            default="vime.rollout.vllm_rollout.generate_rollout",
            help="generate_rollout(args, rollout_id, data_source, evaluation=False).",
        ),
    ),
    (
        "--custom-generate-function-path",
        dict(default=None, help="async generate(args, sample, sampling_params) -> Sample | list[Sample]."),
    ),
    ("--rollout-batch-size", dict(type=int, default=None, help="Prompts (groups) per rollout step.")),
    ("--n-samples-per-prompt", dict(type=int, default=1, help="Responses sampled per prompt (group size).")),
    (
        "--over-sampling-batch-size",
        dict(type=int, default=None, help="Prompts submitted per round when a dynamic filter drops groups."),
    ),
    (
        "--dynamic-sampling-filter-path",
        dict(default=None, help="fn(args, group) -> DynamicFilterOutput(keep, reason)."),
    ),
    (
        "--rollout-sample-filter-path",
        dict(
            default=None, help="fn(args, groups) -> None; sets sample.remove_sample (no loss; baseline kept)."
        ),
    ),
    (
        "--rollout-all-samples-process-path",
        dict(
            default=None,
            help="fn(args, groups, data_source): every finished group, dynamically filtered too.",
        ),
    ),
    (
        "--partial-rollout",
        dict(action="store_true", help="Keep aborted samples and resume them next rollout."),
    ),
    ("--rollout-max-response-len", dict(type=int, default=1024, help="Max new tokens per response.")),
    ("--rollout-temperature", dict(type=float, default=1.0, help="Sampling temperature (> 0).")),
    ("--rollout-top-p", dict(type=float, default=1.0, help="Top-p.")),
    ("--rollout-top-k", dict(type=int, default=-1, help="Top-k (-1: off).")),
    ("--rollout-stop", dict(nargs="+", default=None, help="Stop strings.")),
    ("--rollout-stop-token-ids", dict(type=int, nargs="+", default=None, help="Stop token ids.")),
    (
        "--rollout-skip-special-tokens",
        dict(
            action="store_true",
            help="Leave special tokens out of the response text (default: kept, as in slime; token ids and "
            "log-probs are the same either way).",
        ),
    ),
    (
        "--rollout-data-transport",
        dict(
            default="object-store",
            choices=["object-store", "nixl"],
            help="How rollouts reach the trainers: Ray's object store, by reference (nixl is refused).",
        ),
    ),
    (
        "--rollout-concurrency",
        dict(
            type=int,
            default=512,
            help="Max in-flight requests per engine (a fresh group is one request of n samples), as slime's "
            "--sglang-server-concurrency.",
        ),
    ),
    (
        "--rollout-sample-seeds",
        dict(
            action="store_true",
            help="Send every request its own sampling seed (from --rollout-seed and the sample's index; slime "
            "does so under --sglang-enable-deterministic-inference), so a sample's random draws do not depend on "
            "how the engine batches it. Off by default, as in slime: vLLM draws a seeded request's sampling noise "
            "one request at a time (no throughput cost measured at 256 in-flight requests, bench/README.md). GPU "
            "engines only.",
        ),
    ),
    (
        "--vllm-router-ip",
        dict(default=None, help="Use an existing vllm-router at this address (start none)."),
    ),
    ("--vllm-router-port", dict(type=int, default=None, help="Port of the existing vllm-router.")),
    (
        "--rollout-external-engine-addrs",
        dict(
            nargs="+",
            default=None,
            metavar="HOST:PORT",
            help="Roll out on vLLM engines that are already running (slime's flag): vime checks each one (dev-mode "
            "routes, vime's worker extension, --logprobs-mode processed_logprobs, this run's VIME_CONTROL_SECRET, "
            "--rollout-num-gpus-per-engine workers), puts them behind its router, pushes its weights before "
            "rollout 0 and leaves them running at exit. No engine of vime's own (--rollout-num-gpus 0); not with "
            "--colocate, --offload-rollout, --use-fault-tolerance or --vllm-config, which need engines vime starts.",
        ),
    ),
    (
        "--rollout-request-timeout",
        dict(
            type=float,
            default=1800.0,
            help="Seconds a generation request may wait for its answer (default 1800); one still unanswered (a hung "
            "engine) is aborted and sent straight to another engine that answers /health (the router's cache-aware "
            "policy would send the same prompt back to the hung one), with or without --use-fault-tolerance.",
        ),
    ),
    (
        "--engine-start-timeout",
        dict(type=float, default=600.0, help="Seconds to wait for an engine to become ready."),
    ),
    (
        "--max-staleness",
        dict(
            type=int,
            default=None,
            help="Fully-async rollout (--rollout-function-path vime.rollout.fully_async_rollout.generate_rollout): "
            "most weight versions a trained sample may lag behind the weights that train on it; older groups are "
            "generated again (default 2; train_async.py needs >= 1).",
        ),
    ),
]

REWARD = [
    (
        "--rm-type",
        dict(
            default=None,
            help="Built-in reward (slime's names): math, gsm8k, f1, exact, deepscaler, dapo (dict: --reward-key "
            "score), gpqa, random, remote_rm; boxed_<type> scores the last \\boxed{} only.",
        ),
    ),
    (
        "--custom-rm-path",
        dict(default=None, help="async rm(args, sample) -> float | dict (list with --group-rm)."),
    ),
    (
        "--custom-convert-samples-to-train-data-path",
        dict(
            default=None,
            help="fn(args, samples) -> dict (slime): replaces reward shaping; 'rewards' is required, 'loss_masks', "
            "'rollout_log_probs', 'tokens' and 'response_lengths' replace the samples' own.",
        ),
    ),
    ("--group-rm", dict(action="store_true", help="Call the reward function once per group.")),
    ("--reward-key", dict(default=None, help="Key of a dict reward used for training.")),
    (
        "--eval-reward-key",
        dict(default=None, help="Key of a dict reward used for eval (default: --reward-key)."),
    ),
    ("--rm-url", dict(default=None, help="URL for --rm-type remote_rm.")),
    (
        "--rm-timeout",
        dict(type=float, default=None, help="Seconds per reward call; slower samples are marked FAILED."),
    ),
]
