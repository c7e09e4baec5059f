"""vime's one argument parser: vime groups + Megatron-named flags + ``--vllm-*`` + ``--router-*``.

Flags follow slime's names. ``--vllm-<flag>`` mirrors every flag of the installed vLLM server and
``--router-<flag>`` every flag of the installed vllm-router, generated from their own parsers
(``vime/utils/upstream_parsers.py``); list them with ``--help-vllm`` / ``--help-router``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Sequence

from vime.utils.arg_validation import finalize_args
from vime.utils.megatron_args import add_megatron_arguments
from vime.utils.passthrough_args import add_passthrough_flags, passthrough_help
from vime.utils.refused_flags import add_refused_flags
from vime.utils.upstream_parsers import (
    VIME_OWNED_ROUTER_FLAGS,
    VIME_OWNED_VLLM_FLAGS,
    build_router_parser,
    build_vllm_serve_parser,
)

ADVANTAGE_ESTIMATORS = ["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]
KL_TYPES = ["k1", "k2", "k3", "low_var_kl"]
OPD_TYPES = ["vllm", "trainer", "sglang", "megatron"]  # slime's names last: sglang = vllm, megatron = trainer
EPILOG = """\
Pass-through flags (not listed above):
  --vllm-<flag>    any flag of the installed vLLM server, e.g. --vllm-max-model-len 4096 (list: --help-vllm)
  --router-<flag>  any flag of the installed vllm-router, e.g. --router-policy cache_aware (list: --help-router)
"""


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _add_group(parser: argparse.ArgumentParser, title: str, flags: list[tuple[str, dict]]) -> None:
    group = parser.add_argument_group(title)
    for flag, kwargs in flags:
        group.add_argument(flag, **kwargs)


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
        "--num-gpus-per-node",
        dict(
            type=int, default=8, help="GPUs per node: an engine (--rollout-num-gpus-per-engine) fits in one."
        ),
    ),
    (
        "--colocate",
        dict(action="store_true", help="Training and rollout share GPUs (engines sleep while training)."),
    ),
    ("--offload", dict(action="store_true", help="Same as --offload-train --offload-rollout.")),
    ("--offload-train", dict(action="store_true", help="Move training state off the GPU during rollout.")),
    ("--offload-rollout", dict(action="store_true", help="Sleep vLLM engines during training.")),
]

DATA = [
    ("--hf-checkpoint", dict(default=None, help="HF model dir: tokenizer, config, and initial weights.")),
    ("--prompt-data", dict(default=None, help="Prompt file (.jsonl/.parquet), optionally PATH@[start:end].")),
    ("--input-key", dict(default="prompt", help="Field holding the prompt (string or chat messages).")),
    ("--label-key", dict(default="label", help="Field holding the label.")),
    ("--metadata-key", dict(default="metadata", help="Field holding per-sample metadata (a JSON object).")),
    ("--tool-key", dict(default=None, help="Field holding tool definitions passed to the chat template.")),
    (
        "--apply-chat-template",
        dict(action="store_true", help="Render prompts with the tokenizer's chat template."),
    ),
    (
        "--apply-chat-template-kwargs",
        dict(type=_json_dict, default={}, help="JSON kwargs for apply_chat_template."),
    ),
    (
        "--disable-rollout-global-dataset",
        dict(
            action="store_false",
            dest="rollout_global_dataset",
            help="No prompt dataset (slime): the data source hands out empty samples (after its buffer) to a "
            "--rollout-function-path that makes its own prompts; --prompt-data is then not read.",
        ),
    ),
    (
        "--rollout-max-context-len",
        dict(
            type=int,
            default=None,
            help="Prompt + response token cap: a response stops at this context length (TRUNCATED).",
        ),
    ),
    (
        "--rollout-max-prompt-len",
        dict(
            type=int, default=None, help="Drop prompts longer than this many tokens (counted and reported)."
        ),
    ),
    (
        "--rollout-shuffle",
        dict(action="store_true", help="Shuffle prompts each epoch (seeded by --rollout-seed and epoch)."),
    ),
    (
        "--rollout-seed",
        dict(type=int, default=42, help="Seed for prompt shuffling, engines and per-sample sampling seeds."),
    ),
]

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
        "--vllm-router-ip",
        dict(default=None, help="Use an existing vllm-router at this address (start none)."),
    ),
    ("--vllm-router-port", dict(type=int, default=None, help="Port of the existing vllm-router.")),
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

SCHEDULE = [
    ("--num-rollout", dict(type=int, default=None, help="Rollout steps to run (default: from --num-epoch).")),
    ("--num-epoch", dict(type=int, default=None, help="Passes over --prompt-data (sets --num-rollout).")),
    (
        "--num-steps-per-rollout",
        dict(type=int, default=None, help="Optimizer steps per rollout (sets --global-batch-size)."),
    ),
    (
        "--use-dynamic-batch-size",
        dict(action="store_true", help="Pack micro-batches up to --max-tokens-per-gpu."),
    ),
    (
        "--max-tokens-per-gpu",
        dict(type=int, default=None, help="Token budget per micro-batch with dynamic batching."),
    ),
    ("--gradient-checkpointing", dict(action="store_true", help="Activation checkpointing (fsdp backend).")),
    (
        "--balance-data",
        dict(
            action="store_true",
            help="Balance the estimated training FLOPs (not only the tokens) of each step's data-parallel "
            "shares (slime).",
        ),
    ),
    (
        "--balance-by-flops",
        dict(
            action="store_true",
            help="Pack micro-batches by estimated FLOPs (linear + quadratic in length) instead of tokens; a "
            "micro-batch may then exceed --max-tokens-per-gpu. Needs --use-dynamic-batch-size; implies "
            "--balance-data.",
        ),
    ),
    (
        "--log-probs-max-tokens-per-gpu",
        dict(
            type=int,
            default=None,
            help="Token budget of forward-only micro-batches (old/ref/teacher log-probs, critic values) with "
            "dynamic batching (default: --max-tokens-per-gpu).",
        ),
    ),
    (
        "--log-probs-chunk-size",
        dict(
            type=int,
            default=-1,
            help="Compute log-softmax and entropy over this many tokens at a time (-1: all at once); saves the "
            "memory of full [tokens, vocab] fp32 temporaries.",
        ),
    ),
    (
        "--recompute-loss-function",
        dict(
            action="store_true",
            help="Recompute the loss from the logits in backward instead of keeping its [tokens, vocab] "
            "intermediates (less memory, one more softmax).",
        ),
    ),
    (
        "--data-pad-size-multiplier",
        dict(
            type=int,
            default=1,
            help="Megatron: pad each packed micro-batch to a multiple of this x TP (x CP) tokens, for kernels "
            "that want aligned lengths (slime defaults to 128; vime's kernels need no padding).",
        ),
    ),
    (
        "--allgather-cp",
        dict(
            action="store_true",
            help="Context parallelism that all-gathers keys and values (slime): what vime's CP always does.",
        ),
    ),
    (
        "--update-weights-interval",
        dict(type=int, default=1, help="Push weights to engines every N rollouts (train_async)."),
    ),
]

ALGORITHM = [
    (
        "--advantage-estimator",
        dict(default="grpo", choices=ADVANTAGE_ESTIMATORS, help="Advantage estimator."),
    ),
    (
        "--disable-grpo-std-normalization",
        dict(
            action="store_false",
            dest="grpo_std_normalization",
            help="GRPO/GSPO: subtract the group mean only, no division by the group std (Dr. GRPO).",
        ),
    ),
    (
        "--disable-rewards-normalization",
        dict(
            action="store_false",
            dest="rewards_normalization",
            help="grpo/gspo/reinforce_plus_plus_baseline: train on the raw rewards (no group baseline).",
        ),
    ),
    (
        "--normalize-advantages",
        dict(action="store_true", help="Whiten advantages over the data-parallel batch."),
    ),
    ("--eps-clip", dict(type=float, default=0.2, help="PPO clip range (lower).")),
    ("--eps-clip-high", dict(type=float, default=None, help="PPO clip range (upper; default --eps-clip).")),
    ("--eps-clip-c", dict(type=float, default=None, help="Dual-clip constant (> 1).")),
    ("--kl-coef", dict(type=float, default=0.0, help="KL penalty in the reward (ppo, reinforce++).")),
    ("--use-kl-loss", dict(action="store_true", help="Add KL(policy, ref) to the loss.")),
    (
        "--ref-update-interval",
        dict(type=int, default=None, help="Every N rollouts the reference model takes the policy's weights."),
    ),
    (
        "--reset-optimizer-states",
        dict(
            action="store_true",
            help="After --load, restart Adam's step count (bias correction); moments kept.",
        ),
    ),
    (
        "--use-stateless-adam",
        dict(
            action="store_true",
            help="Adam whose moments restart at zero every optimizer step (slime); needs --optimizer adam and "
            "--no-save-optim.",
        ),
    ),
    (
        "--keep-old-actor",
        dict(
            action="store_true",
            help="Keep a copy of the weights the engines generated with and compute the old log-probs with it "
            "(train_async.py: the trainer is one step ahead of the rollout it trains on).",
        ),
    ),
    (
        "--use-rollout-entropy",
        dict(
            action="store_true",
            help="Also compute the old policy's per-token entropy: logged (train/rollout_entropy) and given to "
            "--rollout-data-postprocess-path as 'entropy'.",
        ),
    ),
    (
        "--rollout-data-postprocess-path",
        dict(
            default=None,
            help="fn(args, rollout_id, rollout_data) after log-probs and advantages (slime): may change "
            "rollout_data's 'loss_masks' and 'advantages' in place before training.",
        ),
    ),
    (
        "--custom-config-path",
        dict(
            default=None,
            help="YAML mapping set on args before validation: settings for your plug-ins (slime).",
        ),
    ),
    ("--kl-loss-coef", dict(type=float, default=0.0, help="Weight of the KL loss.")),
    ("--kl-loss-type", dict(default="k1", choices=KL_TYPES, help="KL estimator for the KL loss.")),
    (
        "--use-unbiased-kl",
        dict(
            action="store_true", help="Weight the KL loss by pi/pi_old (unbiased under the sampling policy)."
        ),
    ),
    ("--entropy-coef", dict(type=float, default=0.0, help="Entropy bonus weight.")),
    ("--gamma", dict(type=float, default=1.0, help="Discount (ppo, reinforce++).")),
    ("--lambd", dict(type=float, default=1.0, help="GAE lambda (ppo).")),
    (
        "--advantage-time-steps",
        dict(
            default="loss_mask",
            choices=["loss_mask", "all"],
            help="Time steps of reinforce++ returns and ppo's GAE when a response has masked (tool/environment) "
            "tokens: loss_mask (only trained tokens; the reward on the last one) or all (slime: every response "
            "token; ppo's reward and KL on every token, the reward on the last). Identical without masked tokens.",
        ),
    ),
    ("--value-clip", dict(type=float, default=0.2, help="Value-loss clip range (ppo).")),
    ("--critic-lr", dict(type=float, default=None, help="Critic learning rate (default --lr).")),
    ("--num-critic-only-steps", dict(type=int, default=0, help="Rollouts that train only the critic first.")),
    (
        "--use-tis",
        dict(
            action="store_true",
            help="Correct the policy loss for the train/rollout mismatch with a TIS function (default: "
            "token-level truncated IS; others in vime.utils.mismatch).",
        ),
    ),
    ("--tis-clip", dict(type=float, default=2.0, help="TIS weight upper bound.")),
    ("--tis-clip-low", dict(type=float, default=0.0, help="TIS weight lower bound.")),
    (
        "--custom-tis-function-path",
        dict(
            default=None,
            help="TIS function (slime's signature), e.g. vime.utils.mismatch.icepop_function, "
            "geometric_tis_function, token_mask_function, sequence_mask_function.",
        ),
    ),
    (
        "--custom-pg-loss-reducer-function-path",
        dict(
            default=None,
            help="fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer of the "
            "per-token pg loss (slime's signature); other terms keep the default reduction.",
        ),
    ),
    (
        "--freeze-params-name-list",
        dict(nargs="*", default=None, help="Regexes (re.search) of parameter names to freeze."),
    ),
    (
        "--only-train-params-name-list",
        dict(
            nargs="*", default=None, help="Regexes of the only parameter names that train; the rest freeze."
        ),
    ),
    (
        "--custom-rollout-log-function-path",
        dict(
            default=None,
            help="fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool (slime); True "
            "drops the default rollout metrics of that step.",
        ),
    ),
    (
        "--custom-eval-rollout-log-function-path",
        dict(
            default=None,
            help="fn(rollout_id, args, data, extra_metrics) -> bool (slime); True drops the default eval metrics.",
        ),
    ),
    (
        "--data-source-path",
        dict(
            default=None,
            help="Data source class, built as cls(args, tokenizer) (default vime.rollout.data_source."
            "RolloutDataSource); needs get_samples, add_samples, state_dict/load_state_dict, save/load.",
        ),
    ),
    (
        "--use-fault-tolerance",
        dict(
            action="store_true",
            help="Replace dead or hung engines during the run: requests in flight on them are sent again, the "
            "replacement rejoins after the next weight sync.",
        ),
    ),
    (
        "--rollout-health-check-interval",
        dict(type=float, default=30.0, help="Seconds between engine health checks (--use-fault-tolerance)."),
    ),
    (
        "--rollout-health-check-timeout",
        dict(type=float, default=30.0, help="Seconds an engine's /health may take before it counts as hung."),
    ),
    (
        "--rollout-health-check-first-wait",
        dict(type=float, default=0.0, help="Seconds before the first health check."),
    ),
    (
        "--rollout-max-engine-restarts",
        dict(type=int, default=3, help="Restarts of one engine before the run stops with its log."),
    ),
    (
        "--buffer-filter-path",
        dict(
            default=None,
            help="fn(args, rollout_id, buffer, num_groups) -> groups it takes out of the data buffer (slime); "
            "default: the first ones.",
        ),
    ),
    (
        "--rollout-sample-hook-path",
        dict(
            action="append",
            default=[],
            help="hook(args, sample, *, rollout_id, evaluation) -> Sample | None on each generated sample before "
            "its reward (sync or async; repeatable).",
        ),
    ),
    (
        "--mask-offpolicy-in-partial-rollout",
        dict(
            action="store_true",
            help="With --partial-rollout: a resumed sample trains only on the tokens generated after it resumed.",
        ),
    ),
    (
        "--log-passrate",
        dict(
            action="store_true",
            help="Log rollout/pass@k (k = 1, 2, 4, ... up to --n-samples-per-prompt; reward >= 1 passes).",
        ),
    ),
    (
        "--train-env-vars",
        dict(
            type=_json_dict,
            default={},
            help='JSON environment variables for the training processes, e.g. {"NCCL_DEBUG": "INFO"}.',
        ),
    ),
    (
        "--get-mismatch-metrics",
        dict(
            action="store_true",
            help="Log train-vs-rollout mismatch metrics each step (mismatch/*: k1/k3 KL, ratio stats, tails, "
            "sequence level, per response position); the loss is unchanged.",
        ),
    ),
    ("--use-opsm", dict(action="store_true", help="Off-policy sequence masking (slime).")),
    (
        "--opsm-delta",
        dict(type=float, default=1e-4, help="OPSM: mask negative-advantage sequences whose KL exceeds this."),
    ),
    (
        "--use-routing-replay",
        dict(
            action="store_true",
            help="MoE routing replay (slime; arXiv 2507.18071): the old-log-prob pass records each router's "
            "top-k experts per token and the step's training forwards/backwards use exactly those.",
        ),
    ),
    (
        "--use-rollout-routing-replay",
        dict(
            action="store_true",
            help="MoE rollout routing replay, R3 (slime; arXiv 2510.11370): engines return the experts they routed "
            "every token to, and every actor forward of the step (old log-probs, reference, training) uses them; "
            "gate weights come from the trainer's router logits. Implies --use-routing-replay; GPU engines only.",
        ),
    ),
    (
        "--use-rollout-logprobs",
        dict(action="store_true", help="Use the engine's log-probs as the old policy."),
    ),
    (
        "--loss-type",
        dict(
            default="policy_loss",
            choices=["policy_loss", "sft_loss", "custom_loss"],
            help="policy_loss (PPO/GRPO), sft_loss (negative log-likelihood of the loss-masked tokens; with "
            "vime.rollout.sft_rollout), or custom_loss (--custom-loss-function-path).",
        ),
    ),
    (
        "--custom-loss-function-path",
        dict(default=None, help="Replace the policy loss (--loss-type custom_loss, or with policy_loss)."),
    ),
    (
        "--disable-compute-advantages-and-returns",
        dict(
            action="store_false",
            dest="compute_advantages_and_returns",
            help="Skip advantages (all zero) for losses that do not use them (SFT, custom losses).",
        ),
    ),
    (
        "--custom-advantage-function-path",
        dict(
            default=None,
            help="Replace the advantage estimator: slime's fn(args, rollout_data) (sets rollout_data['advantages'] "
            "and ['returns']) or fn(args, samples, rewards, log_probs, ref_log_probs, values) -> advantages.",
        ),
    ),
    (
        "--custom-reward-post-process-path",
        dict(
            default=None,
            help="fn(args, samples) -> (raw_rewards, rewards): replaces the group normalisation.",
        ),
    ),
    (
        "--use-opd",
        dict(action="store_true", help="On-policy distillation (slime): needs --opd-type."),
    ),
    (
        "--opd-type",
        dict(
            default=None,
            choices=OPD_TYPES,
            help="Where the teacher's log-probs come from: vllm (a teacher vLLM server, asked during the rollout "
            "by vime.rollout.on_policy_distillation; slime's sglang) or trainer (--opd-teacher-load, run by the "
            "training backend; slime's megatron).",
        ),
    ),
    (
        "--opd-kl-coef",
        dict(
            type=float,
            default=1.0,
            help="OPD weight: advantages -= coef * (logp_student - logp_teacher) per token (with --use-opd).",
        ),
    ),
    (
        "--opd-teacher-load",
        dict(default=None, help="Teacher checkpoint (HF dir or vime checkpoint) for --opd-type trainer."),
    ),
    (
        "--opd-teacher-ckpt-step",
        dict(type=int, default=None, help="Iteration of a checkpoint --opd-teacher-load (default latest)."),
    ),
]

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
        "--check-weight-update-equal",
        dict(
            action="store_true",
            help="After every weight sync compare each engine's log-probs of a fixed sequence with the trainer's; "
            "a mismatch stops the run (slime checks the engines' weights).",
        ),
    ),
    (
        "--update-weight-buffer-size",
        dict(type=int, default=512 * 1024**2, help="Bytes per weight-sync bucket."),
    ),
    ("--update-weight-dir", dict(default=None, help="Shared directory for --update-weight-transport disk.")),
]

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

VIME_GROUPS = [
    ("cluster", CLUSTER),
    ("data", DATA),
    ("rollout", ROLLOUT),
    ("reward", REWARD),
    ("schedule", SCHEDULE),
    ("algorithm", ALGORITHM),
    ("checkpoint (see also the megatron group)", CHECKPOINT),
    ("weight sync", SYNC),
    ("eval", EVAL),
    ("debug and logging", DEBUG_AND_LOGGING),
]


class VimeArgumentParser(argparse.ArgumentParser):
    """ArgumentParser whose unknown-flag errors suggest the closest known flag."""

    def error(self, message: str):  # the usage line of ~700 flags would bury the message
        self.exit(2, f"{self.prog}: error: {message}\n(run '{self.prog} --help' for the flags)\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):  # type: ignore[override]
        parsed, unknown = self.parse_known_args(args, namespace)
        flags = [token for token in unknown if token.startswith("-")]
        if unknown:
            first = (flags or unknown)[0]
            name = first.split("=", 1)[0]
            close = difflib.get_close_matches(name, list(self._option_string_actions), n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            if name.startswith("--vllm-"):
                hint += " (list vLLM flags with --help-vllm)"
            elif name.startswith("--router-"):
                hint += " (list router flags with --help-router)"
            self.error(f"unrecognized argument {first}{hint}")
        return parsed


def build_parser() -> VimeArgumentParser:
    """The full vime parser: vime groups, Megatron flags, and the pass-through flags."""
    parser = VimeArgumentParser(
        prog="vime",
        description="vime: RL post-training with vLLM rollout (slime-compatible flags).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--help-vllm", action="store_true", help="List every --vllm-<flag> and exit.")
    parser.add_argument("--help-router", action="store_true", help="List every --router-<flag> and exit.")
    for title, flags in VIME_GROUPS:
        _add_group(parser, title, flags)
    parser.set_defaults(megatron_args_source=add_megatron_arguments(parser))
    add_refused_flags(parser)
    vllm_parser, router_parser = build_vllm_serve_parser(), build_router_parser()
    parser.vllm_actions = (
        add_passthrough_flags(parser, vllm_parser, "vllm", VIME_OWNED_VLLM_FLAGS) if vllm_parser else []
    )
    parser.router_actions = (
        add_passthrough_flags(parser, router_parser, "router", VIME_OWNED_ROUTER_FLAGS)
        if router_parser
        else []
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate vime's command line (``sys.argv[1:]`` when ``argv`` is None)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.help_vllm or args.help_router:
        actions, title = (
            (parser.vllm_actions, "vLLM server flags (pass as --vllm-<flag>):")
            if args.help_vllm
            else (parser.router_actions, "vllm-router flags (pass as --router-<flag>):")
        )
        print(passthrough_help(actions, title) if actions else "not installed")
        sys.exit(0)
    try:
        finalize_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args
