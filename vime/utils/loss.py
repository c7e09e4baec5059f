"""Per-micro-batch losses: the policy loss (also the signature of ``--custom-loss-function-path``) and the
critic's value loss. Pure tensor code on packed responses, built from ``vime.utils.ppo_utils``.

Micro-batching invariance: every per-token quantity is reduced with ``batch["reduce"]``, which divides by counts
of the *global* batch (all micro-batches of the optimizer step on all data-parallel ranks). So the loss and
metrics of a micro-batch are its share of the global value, and summing them over micro-batches and ranks
(gradients included) gives exactly the loss of the whole global batch.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from typing import Any

import torch

from vime.utils import mismatch, ppo_utils
from vime.utils.algorithm_flags import score_centering_is_mode
from vime.utils.chunked_log_probs import chunked_log_probs
from vime.utils.misc import load_function

Reducer = Callable[[torch.Tensor], torch.Tensor]
DEFAULT_TIS = "vime.utils.mismatch.vanilla_tis_function"
LossOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]


def make_reducer(
    loss_mask: torch.Tensor,
    response_lengths: list[int],
    calculate_per_token_loss: bool,
    global_num_samples: int,
    global_num_tokens: int,
    sample_denominators: torch.Tensor | None = None,
) -> Reducer:
    """``reduce(per_token) -> scalar``: this micro-batch's share of the global loss (``ppo_utils.reduce_token_loss``:
    per-sample token mean / global samples, or per-trajectory with ``sample_denominators``, or with
    ``--calculate-per-token-loss`` token sum / global tokens)."""
    num_tokens = max(global_num_tokens, 1)  # a batch of only removed samples has no tokens and a zero loss

    def reduce(per_token: torch.Tensor) -> torch.Tensor:
        return ppo_utils.reduce_token_loss(
            per_token,
            loss_mask,
            response_lengths,
            calculate_per_token_loss,
            global_num_samples,
            num_tokens,
            sample_denominators,
        )

    return reduce


def policy_loss(
    args: argparse.Namespace, batch: dict[str, Any], log_probs: torch.Tensor, entropy: torch.Tensor | None
) -> LossOutput:
    """The actor's loss for one packed micro-batch (DESIGN.md §6); ``--custom-loss-function-path`` replaces it and
    is called the same way.

    ``batch`` (1-D tensors run over the packed response tokens, ``N = sum(response_lengths)``):
      ``response_lengths`` list[int]; ``loss_mask`` [N] float (0 for FAILED / removed samples);
      ``advantages`` [N]; ``old_log_probs`` [N]; ``ref_log_probs`` [N] or None (no reference model);
      ``rollout_log_probs`` [N] or None (engine did not return them); ``reduce``: the :data:`Reducer`.
    ``log_probs`` [N]: the current policy's log-probs, with grad. ``entropy`` [N] or None: the entropy of each
    predicting distribution (with grad when ``--entropy-coef`` is non-zero or a custom loss is set).

    Returns ``(loss, metrics)``: the scalar loss already reduced with ``batch["reduce"]`` (the trainer calls
    ``backward`` on it), and scalar metrics reduced the same way (the trainer sums them over micro-batches and
    ranks, which gives their global mean).
    """
    reduce = batch["reduce"]
    old_log_probs, lengths = batch["old_log_probs"], batch["response_lengths"]
    if args.advantage_estimator == "gspo":
        ppo_kl = ppo_utils.compute_gspo_kl(
            list(log_probs.split(lengths)),
            list(old_log_probs.split(lengths)),
            list(batch["loss_mask"].split(lengths)),
        )
    else:
        ppo_kl = old_log_probs - log_probs
    metrics: dict[str, torch.Tensor] = {}
    if args.use_score_centering:
        pg_losses = score_centered_losses(args, batch, log_probs, metrics)
        clipfrac = torch.zeros_like(pg_losses)
    elif args.pg_loss_type == "reinforce":
        pg_losses = ppo_utils.compute_reinforce_loss(log_probs, batch["advantages"])
        clipfrac = torch.zeros_like(pg_losses)
    else:
        pg_losses, clipfrac = ppo_utils.compute_policy_loss(
            ppo_kl, batch["advantages"], args.eps_clip, args.eps_clip_high, args.eps_clip_c
        )
    if args.use_opsm:
        keep = mismatch.opsm_mask(
            log_probs, old_log_probs, batch["advantages"], batch["loss_mask"], lengths, args.opsm_delta
        )
        pg_losses = pg_losses * keep
        metrics["opsm_clipfrac"] = reduce(1.0 - keep)
    masks = list(batch["loss_mask"].split(lengths))
    if args.use_tis and not args.use_score_centering:  # score centering weights its own terms
        if batch["rollout_log_probs"] is None:
            raise ValueError("--use-tis needs the engine's log-probs (rollout_log_probs) on every sample")
        tis_fn = load_function(args.custom_tis_function_path or DEFAULT_TIS, "--custom-tis-function-path")
        pg_losses, masks, tis_metrics = tis_fn(
            args,
            pg_loss=pg_losses,
            train_log_probs=list(old_log_probs.split(lengths)),
            rollout_log_probs=list(batch["rollout_log_probs"].split(lengths)),
            loss_masks=masks,
            total_lengths=batch.get("total_lengths"),
            response_lengths=lengths,
        )
        pg_losses = pg_losses * torch.cat(masks).to(pg_losses)  # rejected tokens; denominators stay
        metrics.update({key: reduce(value.detach().float()) for key, value in tis_metrics.items()})
        metrics["ois"] = reduce(torch.exp(-ppo_kl.detach()))
    if args.custom_pg_loss_reducer_function_path:
        make = load_function(
            args.custom_pg_loss_reducer_function_path, "--custom-pg-loss-reducer-function-path"
        )
        pg_loss = make(batch.get("total_lengths"), lengths, masks, args.calculate_per_token_loss)(pg_losses)
    else:
        pg_loss = reduce(pg_losses)
    loss = pg_loss
    metrics.update(pg_loss=pg_loss.detach(), pg_clipfrac=reduce(clipfrac), ppo_kl=reduce(ppo_kl.detach()))
    if entropy is not None:
        entropy_mean = reduce(entropy)
        if args.entropy_coef:
            loss = loss - args.entropy_coef * entropy_mean
        metrics["entropy"] = entropy_mean.detach()
    kl_loss = torch.zeros((), device=log_probs.device)
    if batch["ref_log_probs"] is not None:
        ratio = torch.exp(log_probs - batch["old_log_probs"]) if args.use_unbiased_kl else None
        kl_loss = reduce(
            ppo_utils.compute_approx_kl(log_probs, batch["ref_log_probs"], args.kl_loss_type, ratio)
        )
        if args.use_kl_loss:
            loss = loss + args.kl_loss_coef * kl_loss
    metrics["kl_loss"] = kl_loss.detach()
    metrics["loss"] = loss.detach()
    return loss, metrics


def score_centered_losses(
    args: argparse.Namespace, batch: dict[str, Any], log_probs: torch.Tensor, metrics: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Per-token REINFORCE loss with score centering (``--use-score-centering``): ``−A·(w·logp − c)``, ``w`` the
    sampled token's weight under ``--use-tis`` (trainer vs sampler probability), ``c`` the centering term of
    :func:`~vime.utils.ppo_utils.score_centering_correction`. ``batch`` adds ``rollout_topk_log_probs`` [N, k] (the
    sampler's head; zero-probability padding on environment tokens, which stays finite and is masked by the
    reduction) and ``train_topk_log_probs`` [N, k] (the trainer's at the same tokens, with grad). Adds the ``sc_*``
    metrics."""
    mode = score_centering_is_mode(args)
    sampler_head, train_head = batch.get("rollout_topk_log_probs"), batch.get("train_topk_log_probs")
    if sampler_head is None or train_head is None or batch["rollout_log_probs"] is None:
        raise ValueError(
            "--use-score-centering needs the sampler's log-probs and top-k head on every sample "
            "(rollout_log_probs, rollout_topk_token_ids, rollout_topk_log_probs)"
        )
    correction, sampler_mass, train_mass = ppo_utils.score_centering_correction(
        train_head, sampler_head, mode, args.tis_clip_low, args.tis_clip
    )
    ratio = torch.exp(log_probs.detach().float() - batch["rollout_log_probs"].float())
    weights = ppo_utils.importance_weights(ratio, mode, args.tis_clip_low, args.tis_clip)
    losses = ppo_utils.compute_reinforce_loss(log_probs, batch["advantages"], weights, correction)
    reduce = batch["reduce"]
    metrics.update(
        sc_correction=reduce(correction.detach()),
        sc_sampler_head_mass=reduce(sampler_mass),
        sc_train_head_mass=reduce(train_mass),
    )
    return losses


def value_loss(args: argparse.Namespace, batch: dict[str, Any], values: torch.Tensor) -> LossOutput:
    """The critic's clipped value loss (``--value-clip``) for one packed micro-batch; ``batch`` holds
    ``old_values``, ``returns``, ``loss_mask``, ``response_lengths`` and ``reduce`` as for :func:`policy_loss`."""
    reduce = batch["reduce"]
    losses, clipfrac = ppo_utils.compute_value_loss(
        values, batch["old_values"], batch["returns"], args.value_clip
    )
    loss = reduce(losses)
    return loss, {"loss": loss.detach(), "value_loss": loss.detach(), "value_clipfrac": reduce(clipfrac)}


def sft_loss(
    args: argparse.Namespace, batch: dict[str, Any], log_probs: torch.Tensor, entropy: torch.Tensor | None
) -> LossOutput:
    """``--loss-type sft_loss``: the negative log-likelihood of the loss-masked response tokens, reduced like the
    policy loss (per-sample token mean, or token mean with ``--calculate-per-token-loss``). Same signature as
    :func:`policy_loss`; advantages and old log-probs are not used."""
    loss = batch["reduce"](-log_probs)
    metrics = {"loss": loss.detach(), "sft_loss": loss.detach()}
    if entropy is not None:
        metrics["entropy"] = batch["reduce"](entropy.detach())
    return loss, metrics


# ------------------------------------------------------------------------------ custom losses written for slime
def takes_logits(fn: Callable) -> bool:
    """Whether a ``--custom-loss-function-path`` has slime's signature ``(args, batch, logits, sum_of_sample_mean)``
    rather than vime's ``(args, batch, log_probs, entropy)``."""
    names = list(inspect.signature(fn).parameters)
    return "logits" in names or "sum_of_sample_mean" in names


def slime_loss_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """A micro-batch's loss inputs under slime's keys as well (per-sample lists: ``loss_masks``, ``advantages``,
    ``log_probs`` (the old policy's), ``ref_log_probs``, ``rollout_log_probs``), beside vime's."""
    lengths = batch["response_lengths"]

    def split(values: torch.Tensor | None) -> list[torch.Tensor] | None:
        return None if values is None else list(values.split(lengths))

    return batch | {
        "loss_masks": split(batch["loss_mask"]),
        "advantages": split(batch["advantages"]),
        "log_probs": split(batch["old_log_probs"]),
        "ref_log_probs": split(batch["ref_log_probs"]),
        "rollout_log_probs": split(batch["rollout_log_probs"]),
    }


def get_log_probs_and_entropy(
    logits: torch.Tensor,
    *,
    args: argparse.Namespace,
    unconcat_tokens: list[torch.Tensor],
    total_lengths: list[int],
    response_lengths: list[int],
    with_entropy: bool = False,
    **_: Any,
) -> dict[str, list[torch.Tensor]]:
    """slime's helper of the same name for custom losses, on the logits vime passes them: the ``[response tokens,
    vocab]`` rows that predict each response token (unscaled), in sample order. Returns per-sample ``log_probs`` and,
    with ``with_entropy``, ``entropy``, at ``--rollout-temperature``."""
    labels = torch.cat(
        [torch.as_tensor(t)[-n:] for t, n in zip(unconcat_tokens, response_lengths, strict=True)]
    )
    log_probs, entropy = chunked_log_probs(
        logits,
        labels.to(logits.device),
        args.rollout_temperature,
        with_entropy=with_entropy,
        entropy_requires_grad=True,  # a custom loss may differentiate it
        chunk_size=args.log_probs_chunk_size,
    )
    out = {"log_probs": list(log_probs.split(response_lengths))}
    if entropy is not None:
        out["entropy"] = list(entropy.split(response_lengths))
    return out
