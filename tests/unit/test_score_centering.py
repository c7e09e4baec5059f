"""--pg-loss-type reinforce and --use-score-centering (slime; arXiv:2609.20807) on hand-worked numbers.

The case used throughout: one response token, vocabulary of 4, the trainer's distribution
``p = [1/2, 1/4, 1/8, 1/8]`` (logits ``log p``, temperature 1), the sampler's top-2 head the tokens {0, 1} with
``q = [0.4, 0.4]``, the sampled token 0, advantage ``A = 2``.
Head masses ``P = 0.75``, ``Q = 0.8``; the tail ratio ``ρ = (1 − Q) / (1 − P) = 0.2 / 0.25 = 0.8``.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from vime.utils import ppo_utils
from vime.utils.arguments import parse_args
from vime.utils.loss import make_reducer, policy_loss

P = torch.tensor([0.5, 0.25, 0.125, 0.125])
HEAD_IDS = torch.tensor([[0, 1]])
Q_HEAD = torch.tensor([[0.4, 0.4]])
ADVANTAGE = 2.0
LOG_P0, LOG_P1 = math.log(0.5), math.log(0.25)


def _args(**overrides) -> argparse.Namespace:
    base = dict(advantage_estimator="grpo", pg_loss_type="reinforce", use_score_centering=True, use_tis=False,
                custom_tis_function_path=None, tis_clip=2.0, tis_clip_low=0.0, eps_clip=0.2, eps_clip_high=0.2,
                eps_clip_c=None, entropy_coef=0.0, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1",
                use_unbiased_kl=False, use_opsm=False, custom_pg_loss_reducer_function_path=None)  # fmt: skip
    return argparse.Namespace(**{**base, **overrides})


def _loss(args: argparse.Namespace) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """policy_loss of the one-token case; returns the loss, its metrics and d loss / d logits."""
    logits = P.log().clone().requires_grad_()
    log_probs = ppo_utils.log_probs_from_logits(logits[None], torch.tensor([0]))
    mask = torch.ones(1)
    batch = {
        "response_lengths": [1], "loss_mask": mask, "advantages": torch.tensor([ADVANTAGE]),
        "old_log_probs": log_probs.detach(), "ref_log_probs": None,
        "rollout_log_probs": torch.tensor([math.log(0.4)]), "reduce": make_reducer(mask, [1], False, 1, 1),
        "rollout_topk_log_probs": Q_HEAD.log(),
        "train_topk_log_probs": ppo_utils.head_log_probs_from_logits(logits[None], HEAD_IDS, torch.tensor([0]), log_probs),
    }  # fmt: skip
    loss, metrics = policy_loss(args, batch, log_probs, None)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss, metrics, grad


def test_head_log_probs_from_the_label_log_prob_equal_a_log_softmax_with_its_gradient():
    torch.manual_seed(0)
    logits = torch.randn(5, 11, requires_grad=True)
    ids, labels = torch.randint(0, 11, (5, 3)), torch.randint(0, 11, (5,))
    label_log_probs = ppo_utils.log_probs_from_logits(logits, labels, 0.7)
    head = ppo_utils.head_log_probs_from_logits(logits, ids, labels, label_log_probs, 0.7)
    reference = torch.log_softmax(logits / 0.7, -1).gather(-1, ids)
    torch.testing.assert_close(head, reference, atol=1e-5, rtol=0)
    weight = torch.randn(5, 3)
    (grad,) = torch.autograd.grad((head * weight).sum(), logits)
    (expected,) = torch.autograd.grad((reference * weight).sum(), logits)
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=1e-5)


def test_correction_without_importance_weights():
    # α = ρ = 0.8; coefficients q − α·p over the head = [0.4 − 0.4, 0.4 − 0.2] = [0, 0.2];
    # correction = 0.2·log(1/4) = −0.2772589
    correction, q_mass, p_mass = ppo_utils.score_centering_correction(P.log()[HEAD_IDS], Q_HEAD.log())
    assert correction.item() == pytest.approx(0.2 * LOG_P1, abs=1e-6)
    assert q_mass.item() == pytest.approx(0.8) and p_mass.item() == pytest.approx(0.75)


def test_score_centered_loss_and_gradient():
    # loss = −A·(logp_0 − c) = −2·(−0.6931472 + 0.2772589) = 0.8317766
    loss, metrics, grad = _loss(_args())
    assert loss.item() == pytest.approx(-ADVANTAGE * (LOG_P0 - 0.2 * LOG_P1), abs=1e-6)
    assert metrics["sc_correction"].item() == pytest.approx(0.2 * LOG_P1, abs=1e-6)
    assert metrics["sc_sampler_head_mass"].item() == pytest.approx(0.8)
    assert metrics["sc_train_head_mass"].item() == pytest.approx(0.75)
    # ∇_z logp_j = e_j − p, so the gradient is −A·(e_0 − p − 0.2·(e_1 − p)) = −A·(e_0 − 0.2·e_1 − 0.8·p)
    # = −2·[0.6, −0.4, −0.1, −0.1] = [−1.2, 0.8, 0.2, 0.2]. It equals the dense form −A·(e_0 − q̂) with the
    # modeled sampler q̂ = [0.4, 0.4, ρ/8, ρ/8] = [0.4, 0.4, 0.1, 0.1].
    torch.testing.assert_close(grad, torch.tensor([-1.2, 0.8, 0.2, 0.2]))


def test_a_masked_environment_token_with_a_padding_head_changes_nothing():
    # token 2 is tool output (loss mask 0) with vLLM's zero-probability padding head: same loss, finite gradient
    logits = P.log().repeat(2, 1).requires_grad_()
    log_probs = ppo_utils.log_probs_from_logits(logits, torch.tensor([0, 3]))
    mask = torch.tensor([1.0, 0.0])
    batch = {
        "response_lengths": [2], "loss_mask": mask, "advantages": torch.tensor([ADVANTAGE, ADVANTAGE]),
        "old_log_probs": log_probs.detach(), "ref_log_probs": None,
        "rollout_log_probs": torch.tensor([math.log(0.4), 0.0]), "reduce": make_reducer(mask, [2], False, 1, 1),
        "rollout_topk_log_probs": torch.cat([Q_HEAD.log(), torch.full((1, 2), -9999.0)]),
        "train_topk_log_probs": ppo_utils.head_log_probs_from_logits(
            logits, torch.tensor([[0, 1], [0, 1]]), torch.tensor([0, 3]), log_probs
        ),
    }  # fmt: skip
    for tis in ({}, {"use_tis": True, "tis_clip": 1.2}):
        loss, _ = policy_loss(_args(**tis), batch, log_probs, None)
        (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
        assert torch.isfinite(grad).all() and grad[1].abs().max() == 0
    assert loss.item() == pytest.approx(1.6358274, abs=1e-6)


def test_score_centered_loss_with_tis():
    # --use-tis, bounds [0, 1.2]: the sampled token's ratio p/q = 0.5/0.4 = 1.25 → w = 1.2; head weights
    # [1.2, 0.625]; α = ρ·w(1/ρ) = 0.8·w(1.25) = 0.96; coefficients [0.4·1.2 − 0.96·0.5, 0.4·0.625 − 0.96·0.25]
    # = [0, 0.01]; c = 0.01·log(1/4) = −0.0138629; loss = −2·(1.2·log(1/2) + 0.0138629) = 1.6358274
    loss, _, _ = _loss(_args(use_tis=True, tis_clip=1.2))
    assert loss.item() == pytest.approx(1.6358274, abs=1e-6)


def test_icepop_drops_tokens_outside_the_band():
    # icepop, band [0, 1.2]: ratio 1.25 is outside → w = 0 for the sampled token and for head token 0; head
    # token 1 keeps 0.625; α = 0.8·w(1.25) = 0; coefficients [0, 0.4·0.625] = [0, 0.25];
    # loss = −2·(0 − 0.25·log(1/4)) = −0.6931472
    loss, _, _ = _loss(
        _args(use_tis=True, tis_clip=1.2, custom_tis_function_path="vime.utils.mismatch.icepop_function")
    )
    assert loss.item() == pytest.approx(-ADVANTAGE * (-0.25 * LOG_P1), abs=1e-6)


def test_plain_reinforce_has_no_ratio_and_no_clip():
    # −A·logp_0 = −2·log(1/2) = 1.3862944; gradient −A·(e_0 − p) = −2·[0.5, −0.25, −0.125, −0.125]
    loss, metrics, grad = _loss(_args(use_score_centering=False))
    assert loss.item() == pytest.approx(-ADVANTAGE * LOG_P0, abs=1e-6)
    assert metrics["pg_clipfrac"].item() == 0
    torch.testing.assert_close(grad, torch.tensor([-1.0, 0.5, 0.25, 0.25]))


def test_constant_advantage_has_zero_expected_gradient_on_the_full_vocabulary():
    # With the head covering the whole vocabulary the correction is exact: E_{y~q}[∇(−A·(logp_y − c))] = 0.
    logits = torch.tensor([1.0, -1.0, 0.2, 2.0], requires_grad=True)
    q = torch.tensor([0.15, 0.55, 0.25, 0.05])
    log_p = torch.log_softmax(logits, -1)
    correction, _, _ = ppo_utils.score_centering_correction(log_p[None], q.log()[None])
    expected = (q * ppo_utils.compute_reinforce_loss(log_p, torch.ones(4), None, correction)).sum()
    (grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(grad, torch.zeros(4), atol=1e-6, rtol=0)


BASE = "--train-backend fsdp --hf-checkpoint /m --prompt-data /d.jsonl --rollout-batch-size 4 --n-samples-per-prompt 4 --num-rollout 3".split()


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        parse_args(argv)
    return capsys.readouterr().err


def test_flags_resolve_the_objective():
    assert parse_args(BASE).pg_loss_type == "ppo"
    args = parse_args([*BASE, "--use-score-centering", "--score-centering-top-k", "32"])
    assert (args.pg_loss_type, args.score_centering_top_k) == ("reinforce", 32)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--pg-loss-type", "ppo"], "drop --pg-loss-type ppo"),
        (["--score-centering-top-k", "0"], "--score-centering-top-k 0"),
        (["--rollout-top-p", "0.9"], "untruncated sampling"),
        (["--use-opsm"], "--use-opsm"),
        (
            ["--use-tis", "--custom-tis-function-path", "vime.utils.mismatch.geometric_tis_function"],
            "token-wise",
        ),
        (["--loss-type", "sft_loss"], "policy_loss"),
    ],
)
def test_bad_score_centering_settings_are_refused(flags, message, capsys):
    assert message in _refused([*BASE, "--use-score-centering", *flags], capsys)


def test_tis_weights_the_sampler_even_with_rollout_log_probs_as_the_old_policy():
    # score centering's weights compare the current policy with the sampler, so --use-rollout-logprobs keeps them
    args = _sc_args("--use-tis", "--use-rollout-logprobs")
    assert args.use_tis and args.use_rollout_logprobs


def test_reinforce_refuses_the_dual_clip(capsys):
    assert "REINFORCE has no ratio" in _refused(
        [*BASE, "--pg-loss-type", "reinforce", "--eps-clip-c", "3"], capsys
    )


def test_score_centering_needs_fsdp_and_reinforce_excludes_gspo(capsys):
    assert "vocabulary-parallel" in _refused(
        [*BASE, "--use-score-centering", "--train-backend", "megatron"], capsys
    )
    assert "gspo" in _refused([*BASE, "--pg-loss-type", "reinforce", "--advantage-estimator", "gspo"], capsys)


def test_trainer_takes_the_samples_heads_and_refuses_missing_ones():
    from vime.backends.policy_inputs import sampler_heads_of
    from vime.utils.types import Sample

    sample = Sample(index=0, tokens=[5, 0, 1], response_length=2)
    sample.rollout_topk_token_ids = [[0, 1], [1, 3]]
    sample.rollout_topk_log_probs = [[-0.9, -0.9], [-0.1, -3.0]]
    heads = sampler_heads_of([sample], 2)
    assert heads["rollout_topk_token_ids"][0].tolist() == [[0, 1], [1, 3]]
    with pytest.raises(ValueError, match=r"expected \(2, 3\)"):
        sampler_heads_of([sample], 3)
    with pytest.raises(ValueError, match="carries no rollout_topk_token_ids"):
        sampler_heads_of([Sample(index=1, tokens=[5, 0], response_length=1)], 2)


# ------------------------------------------------------------------------- the sampler's heads from the rollout
def _sc_args(*flags: str) -> argparse.Namespace:
    return parse_args([*BASE, "--use-score-centering", "--score-centering-top-k", "2", *flags])


def test_training_requests_ask_for_the_top_k_and_engines_allow_it():
    from vime.backends.vllm_utils.engine import build_engine_command
    from vime.rollout.vllm_generate import _completion_payload, sampling_params_from_args

    args = _sc_args()
    train, evaluation = sampling_params_from_args(args), sampling_params_from_args(args, evaluation=True)
    assert _completion_payload(args, [1], train, 4)["logprobs"] == 2
    assert _completion_payload(args, [1], evaluation, 4)["logprobs"] == 0  # eval does not train
    assert (
        _completion_payload(parse_args(BASE), [1], sampling_params_from_args(parse_args(BASE)), 4)["logprobs"]
        == 0
    )
    command = build_engine_command(args, "127.0.0.1", 8000)
    assert command[command.index("--max-logprobs") + 1] == "2"
    assert "--max-logprobs" not in build_engine_command(parse_args(BASE), "127.0.0.1", 8000)


def test_a_choice_records_the_sampler_head_of_each_token_and_environment_tokens_get_padding():
    from vime.rollout.vllm_generate import RolloutError, _apply_choice, append_response, reset_to_prompt
    from vime.utils.types import Sample

    args = _sc_args()
    # vLLM's top_logprobs: the top-2 plus the sampled token when it is not among them (token 9 at step 2)
    choice = {
        "token_ids": [5, 9], "text": "ab", "finish_reason": "length",
        "logprobs": {
            "token_logprobs": [-0.1, -3.0],
            "top_logprobs": [{"token_id:5": -0.1, "token_id:6": -2.5},
                             {"token_id:9": -3.0, "token_id:7": -0.2, "token_id:8": -1.9}],
        },
    }  # fmt: skip
    sample = _apply_choice(args, Sample(index=0, tokens=[1, 2]), choice, weight_version=3)
    assert sample.rollout_topk_token_ids == [[5, 6], [7, 8]]
    assert sample.rollout_topk_log_probs == [[-0.1, -2.5], [-0.2, -1.9]]
    append_response(sample, [4], [0.0], "tool", trainable=False)
    assert sample.rollout_topk_token_ids[-1] == [0, 1] and sample.rollout_topk_log_probs[-1] == [-9999.0] * 2
    assert len(sample.rollout_topk_token_ids) == sample.response_length == 3
    assert reset_to_prompt(sample).rollout_topk_token_ids is None
    short = choice | {"logprobs": {"token_logprobs": [-0.1], "top_logprobs": [{"token_id:5": -0.1}]}}
    with pytest.raises(RolloutError, match="expected 2"):
        _apply_choice(args, Sample(index=1, tokens=[1]), short | {"token_ids": [5]}, weight_version=3)
