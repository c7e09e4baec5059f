"""Parse-time checks and derived values of the algorithm's flags: KL and TIS, routing replay, on-policy distillation,
the loss type and the policy-gradient loss (score centering) (errors name the flag and the fix)."""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def check_algorithm_flags(args: argparse.Namespace) -> None:
    """Fill the algorithm's derived values and reject settings that cannot work together (ValueError)."""
    _check_algorithm(args)
    _check_routing_replay(args)
    _check_opd(args)
    _check_loss_type(args)
    _check_pg_loss_type(args)


def _check_algorithm(args: argparse.Namespace) -> None:
    if args.use_kl_loss and args.kl_coef != 0:
        raise ValueError(
            "--kl-coef and --use-kl-loss both set: choose one KL (--kl-coef shapes rewards, --use-kl-loss with "
            "--kl-loss-coef adds a loss term); drop --kl-coef or --use-kl-loss"
        )
    if args.use_tis and args.use_rollout_logprobs and not args.use_score_centering:
        raise ValueError(
            "--use-tis with --use-rollout-logprobs: TIS corrects between the trainer's old log-probs and the "
            "engine's; with rollout log-probs as the old policy the weight is always 1. Drop one of them"
        )
    if args.eps_clip_c is not None and args.eps_clip_c <= 1:
        raise ValueError(f"--eps-clip-c {args.eps_clip_c}: the dual-clip constant must be > 1 (e.g. 3.0)")
    if args.tis_clip_low > args.tis_clip:
        raise ValueError(f"--tis-clip-low {args.tis_clip_low} is above --tis-clip {args.tis_clip}")
    if args.n_samples_per_prompt == 1 and args.advantage_estimator in ("grpo", "gspo"):
        args.grpo_std_normalization = False  # as slime: the std of one sample is undefined
        if args.rewards_normalization and not args.debug_train_only and args.loss_type == "policy_loss":
            logger.warning(
                "--n-samples-per-prompt 1 with --advantage-estimator %s: each group is one sample, so its reward "
                "minus the group mean is 0 and the policy gets no signal (std normalisation is off, as in "
                "slime). Sample more per prompt, or train on raw rewards with --disable-rewards-normalization",
                args.advantage_estimator,
            )


def _check_routing_replay(args: argparse.Namespace) -> None:
    if args.log_logprob_diff_without_replay and not args.use_rollout_routing_replay:
        raise ValueError(
            "--log-logprob-diff-without-replay scores an R3 batch again on the trainer's own routing; without "
            "--use-rollout-routing-replay the logged train_rollout_logprob_abs_diff already is that: drop the flag"
        )
    if args.use_rollout_routing_replay:
        args.use_routing_replay = True  # as slime: R3 is routing replay with the rollout's routing
    if not args.use_routing_replay:
        return
    flag = "--use-rollout-routing-replay" if args.use_rollout_routing_replay else "--use-routing-replay"
    if args.loss_type == "sft_loss":
        raise ValueError(
            f"{flag} with --loss-type sft_loss: SFT has no old-log-prob pass and no rollout routing to replay; "
            "drop the flag"
        )
    if args.keep_old_actor:
        raise ValueError(
            f"{flag} with --keep-old-actor: the old actor computes the old log-probs there, and its routers are not "
            "hooked for replay; drop one of the two"
        )
    if args.use_rollout_logprobs and not args.use_rollout_routing_replay:
        raise ValueError(
            "--use-routing-replay records the routing in the old-log-prob pass, which --use-rollout-logprobs skips; "
            "use --use-rollout-routing-replay (the engines' routing) or drop --use-rollout-logprobs"
        )
    if args.train_backend == "megatron" and not args.num_experts:
        raise ValueError(
            f"{flag} replays the experts of a Mixture-of-Experts model, but --num-experts is not set (a dense "
            "model); drop the flag or pass the MoE model's flags"
        )


# slime's --opd-type names for vime's: the teacher runs in an inference server, or in the training backend
_OPD_TYPE_ALIASES = {"sglang": "vllm", "megatron": "trainer"}


def _check_opd(args: argparse.Namespace) -> None:
    """On-policy distillation as in slime: ``--use-opd`` with ``--opd-type``; ``--opd-teacher-load`` belongs to the
    trainer-side teacher only. slime's type names are mapped to vime's."""
    if not args.use_opd:
        if args.opd_teacher_load or args.opd_type:
            flag = "--opd-teacher-load" if args.opd_teacher_load else "--opd-type"
            raise ValueError(
                f"{flag} is set but --use-opd is not: add --use-opd (and --opd-type trainer for a teacher loaded "
                "by the trainer, or --opd-type vllm for a teacher server)"
            )
        return
    if args.opd_type is None:
        raise ValueError(
            "--use-opd needs --opd-type: vllm (teacher log-probs from a vLLM server during the rollout, "
            "vime.rollout.on_policy_distillation; slime's sglang) or trainer (--opd-teacher-load, run by the "
            "training backend; slime's megatron)"
        )
    args.opd_type = _OPD_TYPE_ALIASES.get(args.opd_type, args.opd_type)
    if args.opd_type == "trainer" and not args.opd_teacher_load:
        raise ValueError(
            "--opd-type trainer needs --opd-teacher-load (HF dir or vime checkpoint of the teacher)"
        )
    if args.opd_type == "vllm":
        if args.opd_teacher_load:
            raise ValueError(
                "--opd-teacher-load with --opd-type vllm: the teacher's log-probs come from its server during the "
                "rollout; drop --opd-teacher-load, or use --opd-type trainer to load the teacher in the trainer"
            )
        if args.rollout_temperature != 1.0:
            raise ValueError(
                f"--opd-type vllm with --rollout-temperature {args.rollout_temperature}: vLLM returns prompt "
                "log-probs of the unscaled logits (temperature 1), while the student's are at the rollout "
                "temperature, so their difference would not be a KL; use --rollout-temperature 1, or --opd-type "
                "trainer (the trainer scales both by the rollout temperature)"
            )


def _check_loss_type(args: argparse.Namespace) -> None:
    if args.loss_type == "custom_loss" and not args.custom_loss_function_path:
        raise ValueError("--loss-type custom_loss needs --custom-loss-function-path (the loss function)")
    if args.loss_type != "sft_loss":
        return
    if args.custom_loss_function_path:
        raise ValueError(
            "--loss-type sft_loss with --custom-loss-function-path: pick one (custom_loss uses the path)"
        )
    ignored = [
        flag
        for flag, on in (
            ("--use-kl-loss", args.use_kl_loss),
            ("--kl-coef", args.kl_coef != 0),
            ("--use-opd", args.use_opd),
            ("--use-tis", args.use_tis),
            ("--advantage-estimator ppo (a critic)", args.advantage_estimator == "ppo"),
            (
                "--rollout-max-prompt-len (SFT conversations are tokenized whole, by the rollout)",
                args.rollout_max_prompt_len,
            ),
        )
        if on
    ]
    if ignored:
        raise ValueError(
            f"--loss-type sft_loss trains on the negative log-likelihood of the loss-masked tokens only; "
            f"{', '.join(ignored)} would not take effect: drop them"
        )


SCORE_CENTERING_TIS = {
    None: "tis",
    "vime.utils.mismatch.vanilla_tis_function": "tis",
    "vime.utils.mismatch.icepop_function": "mis",
}


def score_centering_is_mode(args: argparse.Namespace) -> str:
    """The importance weighting score centering applies to every head token: ``none`` without ``--use-tis``,
    ``tis`` for the default TIS function, ``mis`` for icepop (the only token-wise rules that extend to the head)."""
    if not args.use_tis:
        return "none"
    if args.custom_tis_function_path not in SCORE_CENTERING_TIS:
        raise ValueError(
            f"--use-score-centering with --custom-tis-function-path {args.custom_tis_function_path}: the centering "
            "weights every head token and the modeled tail, which only token-wise TIS rules can do; use the default "
            "TIS or vime.utils.mismatch.icepop_function, or drop --use-score-centering"
        )
    return SCORE_CENTERING_TIS[args.custom_tis_function_path]


def _check_pg_loss_type(args: argparse.Namespace) -> None:
    """Resolve ``--pg-loss-type`` (slime's default: reinforce with score centering, else ppo) and check score
    centering's requirements."""
    if args.pg_loss_type is None:
        args.pg_loss_type = "reinforce" if args.use_score_centering else "ppo"
    if args.pg_loss_type == "reinforce" and args.advantage_estimator == "gspo":
        raise ValueError(
            "--pg-loss-type reinforce with --advantage-estimator gspo: GSPO's objective is the clipped sequence "
            "ratio (ppo); use --advantage-estimator grpo, or --pg-loss-type ppo"
        )
    if args.pg_loss_type == "reinforce" and args.eps_clip_c is not None:
        raise ValueError(
            f"--eps-clip-c {args.eps_clip_c} with --pg-loss-type reinforce: REINFORCE has no ratio to clip; drop "
            "--eps-clip-c, or use --pg-loss-type ppo"
        )
    if not args.use_score_centering:
        return
    if args.pg_loss_type != "reinforce":
        raise ValueError(
            "--use-score-centering centers the REINFORCE score; drop --pg-loss-type ppo (reinforce is the default)"
        )
    if args.score_centering_top_k < 1:
        raise ValueError(f"--score-centering-top-k {args.score_centering_top_k}: must be >= 1 (e.g. 128)")
    if args.rollout_top_p != 1 or args.rollout_top_k not in (-1, 0):
        raise ValueError(
            f"--use-score-centering with --rollout-top-p {args.rollout_top_p} --rollout-top-k {args.rollout_top_k}: "
            "the modeled-tail estimate needs untruncated sampling (the exact truncated-support form is not "
            "implemented); use --rollout-top-p 1 --rollout-top-k -1"
        )
    if args.loss_type != "policy_loss" or args.custom_loss_function_path:
        raise ValueError(
            "--use-score-centering changes vime's policy loss: it needs --loss-type policy_loss without "
            "--custom-loss-function-path"
        )
    if args.train_backend != "fsdp":
        raise ValueError(
            "--use-score-centering needs the trainer's log-probs at the sampler's top-k tokens, computed from the "
            "full-vocabulary logits of --train-backend fsdp (Megatron's are vocabulary-parallel shards); use "
            "--train-backend fsdp"
        )
    conflicts = [
        flag
        for flag, on in (
            ("--use-opd", args.use_opd),
            ("--use-opsm", args.use_opsm),
            ("--use-unbiased-kl", args.use_unbiased_kl),
            ("--custom-pg-loss-reducer-function-path", args.custom_pg_loss_reducer_function_path),
        )
        if on
    ]
    if conflicts:
        raise ValueError(
            f"--use-score-centering cannot combine with {', '.join(conflicts)} (as in slime): drop them"
        )
    score_centering_is_mode(args)
