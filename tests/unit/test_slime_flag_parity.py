"""Issue 15's acceptance test: slime's own flag list (the 223 flags ``slime/utils/arguments.py`` defines itself, in
its order; SGLang's are mirrored as ``--vllm-*``) fed to vime's parser, with the verdict expected for each:

- ``accepted``: parsed with slime's meaning (the example value, plus any companion flags it needs, parses);
- ``refused``: a parse error that names the flag and says why and what to use instead;
- ``sglang``: refused too, but the flag configures SGLang's side (left out of the ratio, like ``--sglang-*``).

At least 90 % of the flags that are not SGLang's must be accepted.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from vime.utils.arguments import parse_args
from vime.utils.refused_flags import REFUSED_SLIME_FLAGS

# slime HEAD 624b824 (2026-08-21): flag -> (verdict, example arguments for accepted ones)
SLIME_FLAGS: dict[str, tuple[str, list[str]]] = {
    "--train-backend": ("accepted", ["megatron", "--debug-rollout-only"]),
    "--debug-rollout-only": ("accepted", []),
    "--debug-train-only": ("accepted", ["--load-debug-rollout-data", "r_{rollout_id}.json"]),
    "--load-debug-rollout-data": ("accepted", ["r_{rollout_id}.json"]),
    "--actor-num-nodes": ("accepted", ["2"]),
    "--actor-num-gpus-per-node": ("accepted", ["2"]),
    "--rollout-num-gpus": ("accepted", ["2"]),
    "--rollout-num-gpus-per-engine": ("accepted", ["2"]),
    "--num-gpus-per-node": ("accepted", ["2"]),
    "--colocate": ("accepted", []),
    "--offload": ("accepted", []),
    "--offload-train": ("accepted", []),
    "--offload-rollout": ("accepted", []),
    "--distributed-backend": ("accepted", ["gloo"]),
    "--distributed-timeout-minutes": ("accepted", ["2"]),
    "--qwen-gdn-backend": ("refused", []),
    "--train-env-vars": ("accepted", ['{"NCCL_DEBUG": "INFO"}']),
    "--update-weight-mode": ("accepted", ["full"]),
    "--update-weight-transport": ("accepted", ["nccl"]),
    "--release-train": ("refused", []),
    "--update-weight-disk-dir": ("accepted", ["/shared/weights"]),
    "--update-weight-disk-keep-files": ("accepted", ["--update-weight-transport", "disk"]),
    "--update-weight-delta-encoding": ("sglang", []),
    "--update-weight-delta-checksum": ("sglang", []),
    "--custom-update-weight-post-write-path": ("accepted", ["my.hook", "--update-weight-transport", "disk"]),
    "--update-weight-local-checkpoint-dir": ("sglang", []),
    "--custom-model-provider-path": (
        "accepted",
        ["my.provider", "--train-backend", "megatron", "--debug-rollout-only"],
    ),
    "--recompute-loss-function": ("accepted", []),
    "--log-probs-chunk-size": ("accepted", ["2"]),
    "--only-train-params-name-list": ("accepted", ["x"]),
    "--freeze-params-name-list": ("accepted", ["x"]),
    "--freeze-indexer": ("refused", []),
    "--allgather-cp": ("accepted", ["--train-backend", "megatron", "--debug-rollout-only"]),
    "--hf-checkpoint": ("accepted", ["Qwen/Qwen3-4B"]),
    "--model-name": ("accepted", ["x"]),
    "--rollout-function-path": ("accepted", ["vime.rollout.sft_rollout.generate_rollout"]),
    "--rollout-temperature": ("accepted", ["0.5"]),
    "--rollout-top-p": ("accepted", ["0.5"]),
    "--rollout-top-k": ("accepted", ["2"]),
    "--rollout-max-context-len": ("accepted", ["2"]),
    "--rollout-max-prompt-len": ("accepted", ["2"]),
    "--rollout-max-response-len": ("accepted", ["2"]),
    "--rollout-skip-special-tokens": ("accepted", []),
    "--rollout-stop": ("accepted", ["x"]),
    "--rollout-stop-token-ids": ("accepted", ["2"]),
    "--rollout-shuffle": ("accepted", []),
    "--rollout-seed": ("accepted", ["2"]),
    "--over-sampling-batch-size": ("accepted", ["2"]),
    "--dynamic-sampling-filter-path": ("accepted", ["x"]),
    "--partial-rollout": ("accepted", []),
    "--mask-offpolicy-in-partial-rollout": ("accepted", []),
    "--custom-generate-function-path": ("accepted", ["x"]),
    "--rollout-sample-hook-path": ("accepted", ["x"]),
    "--custom-rollout-log-function-path": ("accepted", ["x"]),
    "--custom-eval-rollout-log-function-path": ("accepted", ["x"]),
    "--buffer-filter-path": ("accepted", ["x"]),
    "--update-weight-buffer-size": ("accepted", ["2"]),
    "--update-weights-interval": ("accepted", ["2"]),
    "--keep-old-actor": ("accepted", []),
    "--rollout-data-postprocess-path": ("accepted", ["x"]),
    "--rollout-data-transport": ("accepted", ["object-store"]),
    "--rollout-external-engine-addrs": ("accepted", ["127.0.0.1:8000", "127.0.0.1:8001"]),
    "--use-fault-tolerance": ("accepted", []),
    "--rollout-health-check-interval": ("accepted", ["0.5"]),
    "--rollout-health-check-timeout": ("accepted", ["0.5"]),
    "--rollout-health-check-first-wait": ("accepted", ["0.5"]),
    "--num-rollout": ("accepted", ["2"]),
    "--num-epoch": ("accepted", ["2"]),
    "--disable-rollout-global-dataset": ("accepted", ["--rollout-function-path", "my.rollout"]),
    "--data-source-path": ("accepted", ["x"]),
    "--prompt-data": ("accepted", ["x"]),
    "--apply-chat-template": ("accepted", []),
    "--apply-chat-template-kwargs": ("accepted", ['{"enable_thinking": false}']),
    "--input-key": ("accepted", ["x"]),
    "--label-key": ("accepted", ["x"]),
    "--multimodal-keys": ("refused", []),
    "--metadata-key": ("accepted", ["x"]),
    "--tool-key": ("accepted", ["x"]),
    "--start-rollout-id": ("accepted", ["2"]),
    "--rollout-batch-size": ("accepted", ["2"]),
    "--n-samples-per-prompt": ("accepted", ["2"]),
    "--global-batch-size": ("accepted", ["2"]),
    "--num-steps-per-rollout": ("accepted", ["2"]),
    "--micro-batch-size": ("accepted", ["2"]),
    "--balance-data": ("accepted", []),
    "--balance-by-flops": ("accepted", ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096"]),
    "--use-dynamic-batch-size": ("accepted", ["--max-tokens-per-gpu", "4096"]),
    "--max-tokens-per-gpu": ("accepted", ["2"]),
    "--log-probs-max-tokens-per-gpu": (
        "accepted",
        ["8192", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096"],
    ),
    "--eval-function-path": ("accepted", ["x"]),
    "--eval-interval": ("accepted", ["5", "--eval-prompt-data", "aime", "aime.jsonl"]),
    "--eval-prompt-data": ("accepted", ["aime", "aime.jsonl"]),
    "--eval-config": ("accepted", ["@EVAL_YAML"]),
    "--skip-eval-before-train": ("accepted", []),
    "--eval-input-key": ("accepted", ["x"]),
    "--eval-label-key": ("accepted", ["x"]),
    "--eval-tool-key": ("accepted", ["x"]),
    "--n-samples-per-eval-prompt": ("accepted", ["2"]),
    "--eval-temperature": ("accepted", ["0.5"]),
    "--eval-top-p": ("accepted", ["0.5"]),
    "--eval-top-k": ("accepted", ["2"]),
    "--eval-max-response-len": ("accepted", ["2"]),
    "--eval-max-prompt-len": ("accepted", ["2"]),
    "--eval-min-new-tokens": ("accepted", ["2"]),
    "--eval-max-context-len": ("accepted", ["2"]),
    "--ref-load": ("accepted", ["x"]),
    "--ref-ckpt-step": ("accepted", ["2"]),
    "--load": ("accepted", ["x"]),
    "--save": ("accepted", ["x"]),
    "--save-interval": ("accepted", ["2"]),
    "--async-save": ("refused", []),
    "--no-save-optim": ("accepted", []),
    "--save-hf": ("accepted", ["x"]),
    "--seed": ("accepted", ["2"]),
    "--clip-grad": ("accepted", ["0.5"]),
    "--calculate-per-token-loss": ("accepted", []),
    "--lr": ("accepted", ["0.5"]),
    "--num-critic-only-steps": ("accepted", ["2"]),
    "--megatron-config-path": ("accepted", ["x", "--train-backend", "megatron", "--debug-rollout-only"]),
    "--eps-clip": ("accepted", ["0.5"]),
    "--eps-clip-high": ("accepted", ["0.5"]),
    "--eps-clip-c": ("accepted", ["3.0"]),
    "--value-clip": ("accepted", ["0.5"]),
    "--kl-coef": ("accepted", ["0.5"]),
    "--loss-type": ("accepted", ["policy_loss"]),
    "--custom-loss-function-path": ("accepted", ["x"]),
    "--kl-loss-type": ("accepted", ["k1"]),
    "--advantage-estimator": ("accepted", ["grpo"]),
    "--disable-compute-advantages-and-returns": ("accepted", []),
    "--custom-advantage-function-path": ("accepted", ["x"]),
    "--use-kl-loss": ("accepted", []),
    "--kl-loss-coef": ("accepted", ["0.5"]),
    "--use-unbiased-kl": ("accepted", []),
    "--ref-update-interval": ("accepted", ["2"]),
    "--entropy-coef": ("accepted", ["0.5"]),
    "--gamma": ("accepted", ["0.5"]),
    "--lambd": ("accepted", ["0.5"]),
    "--normalize-advantages": ("accepted", []),
    "--disable-grpo-std-normalization": ("accepted", []),
    "--disable-rewards-normalization": ("accepted", []),
    "--use-rollout-entropy": ("accepted", []),
    "--get-mismatch-metrics": ("accepted", []),
    "--reset-optimizer-states": ("accepted", []),
    "--use-stateless-adam": ("accepted", ["--no-save-optim"]),
    "--use-rollout-logprobs": ("accepted", []),
    "--use-tis": ("accepted", []),
    "--tis-clip": ("accepted", ["0.5"]),
    "--tis-clip-low": ("accepted", ["0.5"]),
    "--custom-tis-function-path": ("accepted", ["x"]),
    "--custom-pg-loss-reducer-function-path": ("accepted", ["x"]),
    "--use-routing-replay": ("accepted", []),
    "--use-rollout-routing-replay": ("accepted", []),
    "--use-opsm": ("accepted", []),
    "--opsm-delta": ("accepted", ["0.5"]),
    "--use-opd": ("accepted", ["--opd-type", "sglang"]),
    "--opd-type": ("accepted", ["megatron", "--use-opd", "--opd-teacher-load", "x"]),
    "--opd-kl-coef": ("accepted", ["0.5"]),
    "--opd-teacher-load": ("accepted", ["x", "--use-opd", "--opd-type", "megatron"]),
    "--opd-teacher-ckpt-step": ("accepted", ["2"]),
    "--use-wandb": ("accepted", []),
    "--wandb-mode": ("accepted", ["online"]),
    "--wandb-dir": ("accepted", ["x"]),
    "--wandb-key": ("accepted", ["x"]),
    "--wandb-host": ("accepted", ["x"]),
    "--wandb-team": ("accepted", ["x"]),
    "--wandb-group": ("accepted", ["x"]),
    "--wandb-project": ("accepted", ["x"]),
    "--disable-wandb-random-suffix": ("accepted", []),
    "--wandb-always-use-train-step": ("accepted", []),
    "--log-multi-turn": ("accepted", []),
    "--log-passrate": ("accepted", []),
    "--log-reward-category": ("accepted", ["x"]),
    "--log-correct-samples": ("accepted", []),
    "--wandb-run-id": ("accepted", ["x"]),
    "--use-tensorboard": ("accepted", []),
    "--tb-project-name": ("accepted", ["x"]),
    "--tb-experiment-name": ("accepted", ["x"]),
    "--save-debug-rollout-data": ("accepted", ["x"]),
    "--load-forge-rollout-data": ("accepted", ["x"]),
    "--load-debug-rollout-data-subsample": (
        "accepted",
        ["0.5", "--load-debug-rollout-data", "r_{rollout_id}.json"],
    ),
    "--save-debug-train-data": ("accepted", ["x"]),
    "--dump-details": ("accepted", ["x"]),
    "--memory-snapshot-dir": ("accepted", ["x"]),
    "--memory-snapshot-num-steps": ("accepted", ["2", "--record-memory-history"]),
    "--profile-target": ("accepted", ["train_overall"]),
    "--memory-recorder": ("accepted", ["torch"]),
    "--record-memory-history": ("accepted", []),
    "--check-weight-update-equal": ("accepted", []),
    "--http-proxy": ("refused", []),
    "--use-distributed-post": ("refused", []),
    "--rm-type": ("accepted", ["deepscaler"]),
    "--reward-key": ("accepted", ["x"]),
    "--eval-reward-key": ("accepted", ["x"]),
    "--group-rm": ("accepted", []),
    "--rm-url": ("accepted", ["x"]),
    "--custom-rm-path": ("accepted", ["x"]),
    "--custom-reward-post-process-path": ("accepted", ["x"]),
    "--custom-convert-samples-to-train-data-path": ("accepted", ["x"]),
    "--rollout-buffer-url": ("refused", []),
    "--fetch-trajectory-retry-times": ("refused", []),
    "--min-batch-collection-ratio": ("refused", []),
    "--rollout-task-type": ("refused", []),
    "--loss-mask-type": ("refused", []),
    "--data-pad-size-multiplier": (
        "accepted",
        ["128", "--train-backend", "megatron", "--debug-rollout-only"],
    ),
    "--rollout-sample-filter-path": ("accepted", ["x"]),
    "--rollout-all-samples-process-path": ("accepted", ["x"]),
    "--custom-megatron-init-path": ("accepted", ["x", "--train-backend", "megatron", "--debug-rollout-only"]),
    "--custom-megatron-before-log-prob-hook-path": (
        "accepted",
        ["x", "--train-backend", "megatron", "--debug-rollout-only"],
    ),
    "--custom-megatron-before-train-step-hook-path": (
        "accepted",
        ["x", "--train-backend", "megatron", "--debug-rollout-only"],
    ),
    "--megatron-deepgemm-forward-layers": ("refused", []),
    "--megatron-deepgemm-forward-modules": ("refused", []),
    "--megatron-deepgemm-moe-forward-layers": ("refused", []),
    "--megatron-deepgemm-moe-forward-modules": ("refused", []),
    "--mtp-num-layers": ("accepted", ["0"]),
    "--mtp-loss-scaling-factor": ("refused", []),
    "--enable-mtp-training": ("refused", []),
    "--ci-test": ("accepted", []),
    "--ci-disable-kl-checker": ("accepted", []),
    "--ci-train-rollout-logprob-abs-diff-threshold": ("accepted", ["0.5"]),
    "--ci-save-grad-norm": ("accepted", ["x"]),
    "--ci-load-grad-norm": ("accepted", ["x"]),
    "--custom-config-path": ("accepted", ["@CUSTOM_YAML"]),
    "--padded-vocab-size": ("accepted", ["151936", "--train-backend", "megatron", "--debug-rollout-only"]),
}

BASE = ["--train-backend", "fsdp", "--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2"]  # fmt: skip


def _parse(argv: list[str]) -> tuple[bool, str]:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_args(argv)
    except SystemExit:
        return False, err.getvalue()
    return True, err.getvalue()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("slime_flags")
    (tmp / "eval.yaml").write_text("eval:\n  datasets:\n    - name: aime\n      path: aime.jsonl\n")
    (tmp / "custom.yaml").write_text("my_plugin_setting: 3\n")
    return {"@EVAL_YAML": str(tmp / "eval.yaml"), "@CUSTOM_YAML": str(tmp / "custom.yaml")}


def test_the_list_is_slimes_whole_own_flag_list():
    assert len(SLIME_FLAGS) == 223
    verdicts = {verdict.split(":")[0] for verdict, _ in SLIME_FLAGS.values()}
    assert verdicts == {"accepted", "refused", "sglang"}
    refused = {flag for flag, (verdict, _) in SLIME_FLAGS.items() if verdict in ("refused", "sglang")}
    assert refused == set(
        REFUSED_SLIME_FLAGS
    )  # every refusal vime makes is one of slime's flags, and listed here


@pytest.mark.parametrize("flag", [f for f, (v, _) in SLIME_FLAGS.items() if v == "accepted"])
def test_accepted_flags_parse(flag, files):
    example = [files.get(arg, arg) for arg in SLIME_FLAGS[flag][1]]
    rollouts = [] if flag == "--num-epoch" else ["--num-rollout", "1"]
    ok, err = _parse([*BASE, *rollouts, flag, *example])
    assert ok, err


@pytest.mark.parametrize("flag", [f for f, (v, _) in SLIME_FLAGS.items() if v in ("refused", "sglang")])
def test_refused_flags_fail_with_the_flag_and_the_reason(flag):
    ok, err = _parse([*BASE, "--num-rollout", "1", flag, "1"])
    assert not ok
    message = err.split("error: ", 1)[1]
    assert message.startswith(f"argument {flag}: vime refuses this slime flag: it ")
    reason = message.split("vime refuses this slime flag: it ", 1)[1]
    assert len(reason) > 40 and ("drop it" in reason or " use " in reason or "instead" in reason), reason


def test_at_least_90_percent_of_the_non_sglang_flags_are_accepted():
    counted = [v for v, _ in SLIME_FLAGS.values() if v in ("accepted", "refused")]
    share = counted.count("accepted") / len(counted)
    assert share >= 0.9, f"{counted.count('accepted')} of {len(counted)} accepted ({share:.1%})"
