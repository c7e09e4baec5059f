"""Algorithm flags: advantage estimators, losses, KL, importance-sampling corrections, distillation.

Each group is a list of ``(flag, add_argument kwargs)``; ``vime.utils.arguments`` builds the parser."""

from __future__ import annotations

from vime.utils.flags.types import json_dict

ADVANTAGE_ESTIMATORS = ["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]
KL_TYPES = ["k1", "k2", "k3", "low_var_kl"]
OPD_TYPES = ["vllm", "trainer", "sglang", "megatron"]  # slime's names last: sglang = vllm, megatron = trainer

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
    (
        "--pg-loss-type",
        dict(
            default=None,
            choices=["ppo", "reinforce"],
            help="Policy-gradient objective (slime): ppo (clipped ratio) or reinforce (−A·logp, no ratio). "
            "Default: reinforce with --use-score-centering, else ppo.",
        ),
    ),
    (
        "--use-score-centering",
        dict(
            action="store_true",
            help="REINFORCE with score centering (slime; arXiv:2609.20807): subtract the sampler's expected score, "
            "estimated from its top-k head (--score-centering-top-k) and a modeled tail, so a constant advantage "
            "gives no gradient; composes with --use-tis (TIS or icepop). vime's rollout records the sampler's head "
            "of every token (a custom generate function must set rollout_topk_token_ids / rollout_topk_log_probs). "
            "Needs untruncated sampling (--rollout-top-p 1, --rollout-top-k -1) and --train-backend fsdp.",
        ),
    ),
    (
        "--score-centering-top-k",
        dict(
            type=int, default=128, help="Score centering: the sampler's most likely tokens kept per position."
        ),
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
            "others serve while the replacement starts, and it rejoins after the first weight sync once it is up.",
        ),
    ),
    (
        "--rollout-health-check-interval",
        dict(type=float, default=30.0, help="Seconds between engine health checks (--use-fault-tolerance)."),
    ),
    (
        "--rollout-health-check-timeout",
        dict(
            type=float,
            default=30.0,
            help="Seconds an engine's /health, and a call into its engine core (/is_paused), may take before the "
            "engine counts as hung.",
        ),
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
        "--buffer-sort-by-staleness",
        dict(
            action="store_true",
            help="Serve buffered groups (aborted partial rollouts) oldest weight version first, unversioned ones "
            "last (slime); --buffer-filter-path takes precedence.",
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
            type=json_dict,
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
        "--log-logprob-diff-without-replay",
        dict(
            action="store_true",
            help="With --use-rollout-routing-replay: also score the old log-probs with the trainer's own routing "
            "(one more forward pass per step) and log train/train_rollout_logprob_abs_diff_without_replay, the "
            "train-vs-rollout difference the same batch has without R3 (the paired comparison).",
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
