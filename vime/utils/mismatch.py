"""Train–inference mismatch: what it measures (``--get-mismatch-metrics``) and how the policy loss corrects for it
(``--use-tis`` with a TIS function, ``--use-opsm``), with slime's hook signatures.

``r = log π_train − log π_rollout`` per response token (the trainer's old log-prob against the engine's); the
importance ratio is ``exp(r)``.

TIS functions (``--custom-tis-function-path``, default :func:`vanilla_tis_function`) have slime's signature
``fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs) -> (pg_loss, loss_masks,
metrics)``: ``pg_loss`` is the packed per-token loss, the others per-sample lists; the function returns the
weighted per-token loss, the per-sample masks after any rejection (rejected tokens add nothing; the loss keeps the
original denominators, as slime does) and per-token metric tensors (reduced like the loss). Bounds are
``--tis-clip-low`` / ``--tis-clip``. Built in, by path ``vime.utils.mismatch.<name>``:

- :func:`vanilla_tis_function`: token-level truncated IS, weight ``clamp(ratio, low, high)``;
- :func:`geometric_tis_function`: sequence-level truncated IS with the geometric-mean ratio of each sequence;
- :func:`icepop_function`: token-level masked IS, two-sided (IcePop): weight ``ratio`` inside the band, 0 outside;
- :func:`token_mask_function` / :func:`sequence_mask_function`: rejection: tokens (or whole sequences, by their
  geometric-mean ratio) outside the band are dropped, the rest keep weight 1.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from vime.utils.ppo_utils import compute_tis_weights

PerSample = list[torch.Tensor]
TisOutput = tuple[torch.Tensor, PerSample, dict[str, torch.Tensor]]
# response-position buckets of the per-position metrics: [0, 256), [256, 1024), [1024, 4096), [4096, inf)
POSITION_BUCKETS = (0, 256, 1024, 4096)
# what mismatch_statistics sums (the same keys on every rank, for one all-reduce)
STAT_KEYS = (
    "tokens", "k1", "k3", "abs_diff", "ratio", "ratio_above_2", "ratio_below_0.5", "out_of_band", "train_nll",
    "rollout_nll", "sequences", "seq_k1", "seq_ratio",
    *(f"{name}_pos_{low}" for low in POSITION_BUCKETS for name in ("tokens", "k1", "abs_diff")),
)  # fmt: skip


def _log_ratios(train_log_probs: PerSample, rollout_log_probs: PerSample) -> torch.Tensor:
    return torch.cat(train_log_probs).detach().float() - torch.cat(rollout_log_probs).detach().float()


def _per_token(sequence_values: torch.Tensor, loss_masks: PerSample) -> torch.Tensor:
    """One value per sequence -> the same value on each of its tokens (packed)."""
    lengths = torch.tensor([len(m) for m in loss_masks], device=sequence_values.device)
    return torch.repeat_interleave(sequence_values, lengths)


def _sequence_mean(values: torch.Tensor, loss_masks: PerSample) -> torch.Tensor:
    """Masked mean of a packed per-token tensor over each sequence (0 for a fully masked one)."""
    out = []
    for piece, mask in zip(values.split([len(m) for m in loss_masks]), loss_masks, strict=True):
        mask = mask.to(piece)
        out.append((piece * mask).sum() / mask.sum().clamp(min=1))
    return torch.stack(out) if out else values.new_zeros(0)


def _tis_metrics(ratio: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"tis": ratio, "tis_clipfrac": (weight != ratio).float(), "tis_abs": (ratio - 1).abs()}


def vanilla_tis_function(
    args, *, pg_loss: torch.Tensor, train_log_probs: PerSample, rollout_log_probs: PerSample,
    loss_masks: PerSample, **kwargs: Any,
) -> TisOutput:  # fmt: skip
    """Token-level truncated importance sampling: ``pg_loss * clamp(ratio, --tis-clip-low, --tis-clip)``."""
    train, rollout = (
        torch.cat(train_log_probs).to(pg_loss.device),
        torch.cat(rollout_log_probs).to(pg_loss.device),
    )
    weight = compute_tis_weights(train, rollout, args.tis_clip_low, args.tis_clip)
    return (
        pg_loss * weight,
        loss_masks,
        _tis_metrics((train.detach().float() - rollout.float()).exp(), weight),
    )


def geometric_tis_function(
    args, *, pg_loss: torch.Tensor, train_log_probs: PerSample, rollout_log_probs: PerSample,
    loss_masks: PerSample, **kwargs: Any,
) -> TisOutput:  # fmt: skip
    """Sequence-level truncated IS: every token of a sequence is weighted by the sequence's geometric-mean ratio
    ``exp(mean r)``, clamped to ``[--tis-clip-low, --tis-clip]`` (low variance; bounds near 1, e.g. 0.999/1.001)."""
    log_ratio = _log_ratios(train_log_probs, rollout_log_probs).to(pg_loss.device)
    ratio = _per_token(_sequence_mean(log_ratio, loss_masks).exp(), loss_masks)
    weight = ratio.clamp(args.tis_clip_low, args.tis_clip)
    return pg_loss * weight, loss_masks, _tis_metrics(ratio, weight)


def icepop_function(
    args, *, pg_loss: torch.Tensor, train_log_probs: PerSample, rollout_log_probs: PerSample,
    loss_masks: PerSample, **kwargs: Any,
) -> TisOutput:  # fmt: skip
    """Token-level masked IS, two-sided (IcePop): weight ``ratio`` inside ``[--tis-clip-low, --tis-clip]``, 0 outside."""
    ratio = _log_ratios(train_log_probs, rollout_log_probs).exp().to(pg_loss.device)
    inside = (ratio >= args.tis_clip_low) & (ratio <= args.tis_clip)
    weight = torch.where(inside, ratio, torch.zeros_like(ratio))
    return pg_loss * weight, loss_masks, _tis_metrics(ratio, weight)


def _reject(
    pg_loss: torch.Tensor, ratio: torch.Tensor, keep: torch.Tensor, loss_masks: PerSample
) -> TisOutput:
    kept = keep.to(pg_loss.dtype)
    masks = [m * k.to(m) for m, k in zip(loss_masks, kept.split([len(m) for m in loss_masks]), strict=True)]
    return pg_loss * kept, masks, {"tis": ratio, "tis_clipfrac": 1.0 - kept, "tis_abs": (ratio - 1).abs()}


def token_mask_function(
    args, *, pg_loss: torch.Tensor, train_log_probs: PerSample, rollout_log_probs: PerSample,
    loss_masks: PerSample, **kwargs: Any,
) -> TisOutput:  # fmt: skip
    """Token-level rejection: tokens whose ratio leaves ``[--tis-clip-low, --tis-clip]`` are dropped."""
    ratio = _log_ratios(train_log_probs, rollout_log_probs).exp().to(pg_loss.device)
    return _reject(pg_loss, ratio, (ratio >= args.tis_clip_low) & (ratio <= args.tis_clip), loss_masks)


def sequence_mask_function(
    args, *, pg_loss: torch.Tensor, train_log_probs: PerSample, rollout_log_probs: PerSample,
    loss_masks: PerSample, **kwargs: Any,
) -> TisOutput:  # fmt: skip
    """Sequence-level rejection: sequences whose geometric-mean ratio leaves the band are dropped whole."""
    log_ratio = _log_ratios(train_log_probs, rollout_log_probs).to(pg_loss.device)
    ratio = _per_token(_sequence_mean(log_ratio, loss_masks).exp(), loss_masks)
    return _reject(pg_loss, ratio, (ratio >= args.tis_clip_low) & (ratio <= args.tis_clip), loss_masks)


def opsm_mask(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths: list[int],
    delta: float,
) -> torch.Tensor:
    """Off-policy sequence masking (slime's ``--use-opsm``): 0 on the tokens with a negative advantage of every
    sequence whose mean ``old − new`` log-prob over its trained tokens exceeds ``delta`` (``--opsm-delta``), 1
    elsewhere. Packed 1-D tensors over the responses; no gradient."""
    masks = list(loss_mask.split(response_lengths))
    seq_kl = _per_token(_sequence_mean((old_log_probs - log_probs).detach().float(), masks), masks)
    return 1.0 - ((advantages < 0) & (seq_kl > delta)).to(log_probs.dtype)


# ------------------------------------------------------------------------------------------- mismatch metrics
def mismatch_statistics(
    train_log_probs: PerSample, rollout_log_probs: PerSample, loss_masks: PerSample, band: tuple[float, float]
) -> tuple[dict[str, float], dict[str, float]]:
    """Sums and maxima over this rank's trained tokens (and sequences) from which :func:`mismatch_metrics` makes
    the step's metrics once they are summed (maxima: max-reduced) over data-parallel ranks. ``band``: the
    ``(--tis-clip-low, --tis-clip)`` bounds whose out-of-band share is reported."""
    sums = dict.fromkeys(STAT_KEYS, 0.0)
    maxima = {"ratio_max": -math.inf, "neg_ratio_min": -math.inf, "seq_ratio_max": -math.inf,
              "neg_seq_ratio_min": -math.inf}  # fmt: skip

    def add(key: str, value: float) -> None:
        sums[key] += float(value)

    for train, rollout, mask in zip(train_log_probs, rollout_log_probs, loss_masks, strict=True):
        keep = mask.bool()
        r = (train.float() - rollout.float())[keep]
        positions = torch.arange(len(mask))[keep]
        if r.numel() == 0:
            continue
        ratio = r.exp()
        add("tokens", r.numel())
        add("k1", (-r).sum())
        add("k3", (ratio - r - 1).sum())
        add("abs_diff", r.abs().sum())
        add("ratio", ratio.sum())
        add("ratio_above_2", (ratio > 2).sum())
        add("ratio_below_0.5", (ratio < 0.5).sum())
        add("out_of_band", ((ratio < band[0]) | (ratio > band[1])).sum())
        add("train_nll", -train.float()[keep].sum())
        add("rollout_nll", -rollout.float()[keep].sum())
        maxima["ratio_max"] = max(maxima["ratio_max"], float(ratio.max()))
        maxima["neg_ratio_min"] = max(maxima["neg_ratio_min"], -float(ratio.min()))
        seq_ratio = float(r.mean().exp())
        add("sequences", 1)
        add("seq_k1", -r.mean())
        add("seq_ratio", seq_ratio)
        maxima["seq_ratio_max"] = max(maxima["seq_ratio_max"], seq_ratio)
        maxima["neg_seq_ratio_min"] = max(maxima["neg_seq_ratio_min"], -seq_ratio)
        for low, high in zip(POSITION_BUCKETS, (*POSITION_BUCKETS[1:], None), strict=True):
            inside = positions >= low if high is None else (positions >= low) & (positions < high)
            if inside.any():
                add(f"tokens_pos_{low}", inside.sum())
                add(f"k1_pos_{low}", (-r[inside]).sum())
                add(f"abs_diff_pos_{low}", r[inside].abs().sum())
    return sums, maxima


def mismatch_metrics(sums: dict[str, float], maxima: dict[str, float]) -> dict[str, float]:
    """The step's ``mismatch/*`` metrics from the (globally reduced) :func:`mismatch_statistics`: token-level k1
    and k3 KL of the rollout policy from the trainer's, mean |r|, the ratio's mean/min/max and tail shares (> 2,
    < 0.5, outside the TIS band), both policies' log-perplexities, sequence-level k1 and geometric-mean ratio
    (mean/min/max), and k1 / mean |r| per response-position bucket (``pos_<start>``)."""
    tokens, sequences = sums.get("tokens", 0.0), sums.get("sequences", 0.0)
    if not tokens:
        return {}
    out = {f"mismatch/{k}": sums[k] / tokens for k in ("k1", "k3", "abs_diff", "ratio")}
    out |= {
        "mismatch/ratio_min": -maxima["neg_ratio_min"],
        "mismatch/ratio_max": maxima["ratio_max"],
        "mismatch/ratio_above_2_fraction": sums["ratio_above_2"] / tokens,
        "mismatch/ratio_below_0.5_fraction": sums["ratio_below_0.5"] / tokens,
        "mismatch/tis_band_out_fraction": sums["out_of_band"] / tokens,
        "mismatch/train_log_ppl": sums["train_nll"] / tokens,
        "mismatch/rollout_log_ppl": sums["rollout_nll"] / tokens,
        "mismatch/seq_k1": sums["seq_k1"] / sequences,
        "mismatch/seq_ratio": sums["seq_ratio"] / sequences,
        "mismatch/seq_ratio_min": -maxima["neg_seq_ratio_min"],
        "mismatch/seq_ratio_max": maxima["seq_ratio_max"],
    }
    for low in POSITION_BUCKETS:
        if count := sums.get(f"tokens_pos_{low}"):
            out[f"mismatch/k1_pos_{low}"] = sums[f"k1_pos_{low}"] / count
            out[f"mismatch/abs_diff_pos_{low}"] = sums[f"abs_diff_pos_{low}"] / count
    return out
