"""Backend-neutral preparation of a rollout for training (shared by the FSDP and Megatron trainers).

The driver shapes the rewards of the whole rollout (:func:`shape_rewards`) and splits it into per-data-parallel
rank partitions (:func:`split_rollout`); each rank groups its partition into micro-batches
(:func:`fixed_micro_batches` / :func:`dynamic_micro_batches`), packs each micro-batch into one flat row
(:func:`pack_samples`) and turns rewards into per-token advantages (:func:`compute_advantages_and_returns`).

Samples that do not train: a FAILED sample or one with ``remove_sample=True`` keeps its place in the batch (it
counts in the number of samples the per-sample-mean loss divides by, on every rank the same way) but its loss
mask is all zeros (:func:`loss_mask_of`), so it adds nothing to the loss, the token counts or the gradient; its
shaped reward is 0 and it is left out of its group's mean and std.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from vime.utils import ppo_utils
from vime.utils.distributed import all_gather_1d
from vime.utils.misc import load_function
from vime.utils.routing_replay import MicroBatchRouting
from vime.utils.types import Sample, Status

Routes = Sequence[np.ndarray | torch.Tensor | None]

GROUP_BASELINE_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus_baseline")


def is_trainable(sample: Sample) -> bool:
    """Whether a sample contributes to the loss (not FAILED, not ``remove_sample``)."""
    return sample.status != Status.FAILED and not sample.remove_sample


def loss_mask_of(sample: Sample) -> torch.Tensor:
    """The float loss mask over the response: ``sample.loss_mask`` (all ones if None), zeros if not trainable."""
    if sample.loss_mask is not None and len(sample.loss_mask) != sample.response_length:
        raise ValueError(
            f"sample {sample.index}: len(loss_mask)={len(sample.loss_mask)} != response_length="
            f"{sample.response_length}; the loss mask covers the response tokens only"
        )
    if not is_trainable(sample):
        return torch.zeros(sample.response_length)
    if sample.loss_mask is None:
        return torch.ones(sample.response_length)
    return torch.tensor(sample.loss_mask, dtype=torch.float32)


# --------------------------------------------------------------------------------------------- reward shaping
def shape_rewards(args: argparse.Namespace, groups: list[list[Sample]]) -> list[float]:
    """The training reward of every sample, flattened group by group (DESIGN.md §6).

    grpo / gspo / reinforce_plus_plus_baseline: ``r − mean(group)``, and for grpo/gspo ``/ (std + 1e-6)`` unless
    ``--disable-grpo-std-normalization``; the statistics leave FAILED samples out (they have no meaningful
    reward) but keep samples a filter marked ``remove_sample`` (as slime: removal changes the loss, not the
    baseline). A group with fewer than two rewarded samples has no baseline to compare against, so its samples
    get 0. ppo / reinforce_plus_plus, or ``--disable-rewards-normalization``: the raw reward. FAILED samples get
    0. Dict rewards are read with ``--reward-key``. ``--custom-reward-post-process-path`` replaces all of this:
    ``fn(args, samples) -> (raw_rewards, rewards)`` over the flattened samples, as in slime.
    """
    if getattr(args, "custom_reward_post_process_path", None):
        post_process = load_function(
            args.custom_reward_post_process_path, "--custom-reward-post-process-path"
        )
        samples = [s for group in groups for s in group]
        _, rewards = post_process(args, samples)
        if len(rewards) != len(samples):
            raise ValueError(
                f"--custom-reward-post-process-path returned {len(rewards)} rewards for {len(samples)} samples"
            )
        return [float(r) for r in rewards]
    grouped = args.advantage_estimator in GROUP_BASELINE_ESTIMATORS and args.rewards_normalization
    normalize_std = args.advantage_estimator in ("grpo", "gspo") and args.grpo_std_normalization
    shaped: list[float] = []
    for group in groups:
        out = [0.0] * len(group)
        trainable = [i for i, s in enumerate(group) if s.status != Status.FAILED]
        rewards = [group[i].reward_value(args.reward_key) for i in trainable]
        if grouped and len(trainable) >= 2:
            rewards = ppo_utils.normalize_group_rewards(
                torch.tensor(rewards), len(trainable), normalize_std=normalize_std
            ).tolist()
        if grouped and len(trainable) < 2:
            rewards = [0.0] * len(trainable)
        for i, r in zip(trainable, rewards, strict=True):
            out[i] = float(r)
        shaped.extend(out)
    return shaped


# Keys of slime's train-data dict that describe the samples but that vime derives itself from them.
_DERIVED_TRAIN_DATA_KEYS = ("raw_reward", "truncated", "sample_indices", "rollout_ids", "rollout_mask_sums")
_SAMPLE_TRAIN_DATA_KEYS = {
    "tokens": "tokens",
    "response_lengths": "response_length",
    "loss_masks": "loss_mask",
    "rollout_log_probs": "rollout_log_probs",
}


def train_samples_and_rewards(
    args: argparse.Namespace, groups: list[list[Sample]]
) -> tuple[list[Sample], list[float]]:
    """The rollout's samples, flattened group by group, and their training rewards: :func:`shape_rewards`, or
    ``--custom-convert-samples-to-train-data-path`` ``fn(args, samples) -> dict`` (slime). Its ``rewards`` (one per
    sample, required) are the training rewards as they are; ``tokens``, ``response_lengths``, ``loss_masks`` and
    ``rollout_log_probs`` replace the samples' own; the keys slime derives from the samples (``raw_reward``,
    ``truncated``, ``sample_indices``, ``rollout_ids``, ``rollout_mask_sums``) are derived by vime; any other key is
    an error (vime would not use it)."""
    samples = [s for group in groups for s in group]
    path = getattr(args, "custom_convert_samples_to_train_data_path", None)
    if not path:
        return samples, shape_rewards(args, groups)
    flag = "--custom-convert-samples-to-train-data-path"
    data = load_function(path, flag)(args, samples)
    if not isinstance(data, dict) or "rewards" not in data:
        raise ValueError(f"{flag} {path} must return a dict with 'rewards' (one per sample)")
    unknown = set(data) - {"rewards", *_SAMPLE_TRAIN_DATA_KEYS, *_DERIVED_TRAIN_DATA_KEYS}
    if unknown:
        raise ValueError(
            f"{flag} {path} returned keys vime does not train on: {sorted(unknown)}; it reads rewards, "
            f"{', '.join(_SAMPLE_TRAIN_DATA_KEYS)} (derives {', '.join(_DERIVED_TRAIN_DATA_KEYS)} itself)"
        )
    for key in ("rewards", *_SAMPLE_TRAIN_DATA_KEYS):
        if key in data and len(data[key]) != len(samples):
            raise ValueError(f"{flag} {path}: {len(data[key])} {key} for {len(samples)} samples")
    for key, attr in _SAMPLE_TRAIN_DATA_KEYS.items():
        for sample, value in zip(samples, data.get(key, ()), strict=False):
            setattr(sample, attr, value.tolist() if isinstance(value, torch.Tensor) else value)
    return samples, [float(r) for r in data["rewards"]]


# ---------------------------------------------------------------------------------------------- partitioning
def balanced_partitions(lengths: list[int], num_partitions: int, equal_size: bool) -> list[list[int]]:
    """Split indices ``0..len(lengths)-1`` into ``num_partitions`` parts with near-equal token sums.

    Greedy longest-first: each item (longest first) goes to the part with the fewest tokens so far, among the
    parts that are not full when ``equal_size`` (then ``len(lengths)`` must divide evenly). Every part is
    non-empty when ``num_partitions <= len(lengths)``. Indices inside a part are ascending.
    """
    n = len(lengths)
    if num_partitions < 1 or (equal_size and n % num_partitions):
        raise ValueError(f"cannot split {n} items into {num_partitions} equal parts")
    capacity = n // num_partitions if equal_size else n
    parts: list[list[int]] = [[] for _ in range(num_partitions)]
    loads = [0] * num_partitions
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        open_parts = [p for p in range(num_partitions) if len(parts[p]) < capacity]
        p = min(open_parts, key=lambda p: (loads[p], len(parts[p]), p))
        parts[p].append(i)
        loads[p] += lengths[i]
    return [sorted(part) for part in parts]


def split_rollout(lengths: list[float], dp_size: int, global_batch_size: int) -> list[list[int]]:
    """Indices of the rollout's samples for each data-parallel rank.

    The rollout (``lengths[i]`` = total tokens of sample ``i``, or its estimated FLOPs with ``--balance-data``,
    in rollout order) is cut into optimizer steps of ``global_batch_size`` consecutive samples; each step is split
    into ``dp_size`` equal-sized parts balanced by those sums, and rank ``r`` gets its part of every step. So each rank holds the same number of
    samples, and a trainer that cuts its partition into ``len // num_steps`` consecutive chunks trains each step on
    exactly the same global batch whatever ``dp_size`` is.
    """
    n = len(lengths)
    if n % global_batch_size or global_batch_size % dp_size:
        raise ValueError(
            f"{n} samples do not split into steps of --global-batch-size {global_batch_size} and then into "
            f"{dp_size} data-parallel ranks; make the rollout size a multiple of the global batch size, and that "
            "a multiple of the number of training ranks"
        )
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    for start in range(0, n, global_batch_size):
        step = lengths[start : start + global_batch_size]
        for r, part in enumerate(balanced_partitions(step, dp_size, equal_size=True)):
            ranks[r].extend(start + i for i in part)
    return ranks


# ---------------------------------------------------------------------------------------------- micro-batches
def fixed_micro_batches(num_samples: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive micro-batches of ``micro_batch_size`` samples (the last may be shorter)."""
    return [
        list(range(i, min(i + micro_batch_size, num_samples)))
        for i in range(0, num_samples, micro_batch_size)
    ]


def _first_fit_decreasing(lengths: list[int], max_tokens: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:  # also the home of a sample longer than max_tokens, which cannot be split
            bins.append([i])
            loads.append(lengths[i])
    return bins


def min_micro_batches(lengths: list[int], max_tokens: int) -> int:
    """How many micro-batches of at most ``max_tokens`` tokens these samples need (first-fit decreasing).

    With data parallelism every rank must run the same number of forward/backward passes (FSDP collectives):
    take the maximum of this over ranks and pass it to :func:`dynamic_micro_batches`.
    """
    return len(_first_fit_decreasing(lengths, max_tokens))


def dynamic_micro_batches(lengths: list[int], max_tokens: int, num_micro_batches: int) -> list[list[int]]:
    """Exactly ``num_micro_batches`` non-empty micro-batches of at most ``max_tokens`` tokens each, balanced by
    tokens. A sample longer than ``max_tokens`` sits alone in its micro-batch.

    Needs ``min_micro_batches(lengths, max_tokens) <= num_micro_batches <= len(lengths)``. Tries the balanced
    greedy split first; if that breaks the budget, takes the first-fit-decreasing bins and splits the fullest
    multi-sample bin in two until there are enough (splitting never breaks the budget).
    """
    if not min_micro_batches(lengths, max_tokens) <= num_micro_batches <= len(lengths):
        raise ValueError(
            f"cannot make {num_micro_batches} micro-batches of <= {max_tokens} tokens from {len(lengths)} samples"
        )

    def tokens(b: list[int]) -> int:
        return sum(lengths[i] for i in b)

    bins = balanced_partitions(lengths, num_micro_batches, equal_size=False)
    if any(len(b) > 1 and tokens(b) > max_tokens for b in bins):
        bins = _first_fit_decreasing(lengths, max_tokens)
        while len(bins) < num_micro_batches:
            fullest = max((b for b in bins if len(b) > 1), key=tokens)
            bins.remove(fullest)
            halves = balanced_partitions([lengths[i] for i in fullest], 2, equal_size=False)
            bins.extend([fullest[j] for j in half] for half in halves)
    return sorted(sorted(b) for b in bins)


# ----------------------------------------------------------------------------------------------------- packing
@dataclass
class PackedBatch:
    """Samples concatenated into one row with no padding; attention must not cross sample boundaries.

    ``position_ids`` restart at 0 for every sample (that is how the model tells the samples apart).
    """

    input_ids: torch.Tensor  # [T] int64, all samples' prompt + response tokens
    position_ids: torch.Tensor  # [T] int64
    total_lengths: list[int]  # tokens per sample
    response_lengths: list[int]  # response tokens per sample (the last ones of each sample)
    routing: MicroBatchRouting | None = (
        None  # MoE experts to replay per token (routing replay), rows as input_ids
    )

    def response_spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each sample's response tokens in the row."""
        spans, offset = [], 0
        for total, response in zip(self.total_lengths, self.response_lengths, strict=True):
            offset += total
            spans.append((offset - response, offset))
        return spans

    def logit_indices(self) -> torch.Tensor:
        """Row positions whose outputs predict the response tokens (each span shifted left by one), concatenated
        over samples; ``input_ids[logit_indices() + 1]`` are the response tokens."""
        return torch.cat([torch.arange(s - 1, e - 1) for s, e in self.response_spans()])


def pack_samples(samples: list[Sample], routes: Routes | None = None) -> PackedBatch:
    """Pack samples into one :class:`PackedBatch` (every response needs at least one prompt token before it), with
    the MoE experts to replay for them when ``routes`` (one array or None per sample: :func:`pack_routing`)."""
    for s in samples:
        if s.response_length > 0 and s.prompt_length < 1:
            raise ValueError(
                f"sample {s.index}: response_length={s.response_length} with {len(s.tokens)} tokens leaves no "
                "prompt token to predict the first response token from"
            )
    lengths = [len(s.tokens) for s in samples]
    return PackedBatch(
        input_ids=torch.tensor([t for s in samples for t in s.tokens], dtype=torch.long),
        position_ids=torch.cat([torch.arange(n) for n in lengths]),
        total_lengths=lengths,
        response_lengths=[s.response_length for s in samples],
        routing=pack_routing(routes, lengths) if routes is not None else None,
    )


def pack_routing(routes: Routes, lengths: Sequence[int]) -> MicroBatchRouting | None:
    """Per-sample routing arrays (``[rows, layers, topk]``, see ``vime.utils.routed_experts``) -> the routing of
    the packed row of those samples (``lengths`` tokens each, in order). A sample's array covers its first
    ``rows`` tokens; its other tokens (the last one, which the engine never fed back) and samples without an
    array route on the model's own choice. None when no sample has an array."""
    routes = [_int32(r) if r is not None else None for r in routes]
    present = [r for r in routes if r is not None]
    if not present:
        return None
    shape = tuple(present[0].shape[1:])
    experts = torch.zeros((sum(lengths), *shape), dtype=torch.int32)
    mask = torch.zeros(sum(lengths), dtype=torch.bool)
    offset = 0
    for i, (route, length) in enumerate(zip(routes, lengths, strict=True)):
        if route is not None:
            if route.ndim != 3 or len(route) > length or tuple(route.shape[1:]) != shape:
                raise ValueError(
                    f"sample {i} of the micro-batch: routing of shape {tuple(route.shape)} for {length} tokens; "
                    f"expected at most {length} rows of {shape} (layers, top-k)"
                )
            experts[offset : offset + len(route)] = route
            mask[offset : offset + len(route)] = True
        offset += length
    return MicroBatchRouting(experts, mask)


def _int32(route: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(route, torch.Tensor):
        return route.to(torch.int32)
    return torch.from_numpy(np.asarray(route).astype(np.int32))  # numpy's uint16 has few torch ops


def split_routing(experts: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """A packed row's ``[rows, layers, topk]`` experts -> one ``[length, layers, topk]`` CPU tensor per sample."""
    return [part.cpu() for part in experts.split(list(lengths))]


# ------------------------------------------------------------------------------------ advantages and returns
def token_kl(
    args: argparse.Namespace,
    loss_masks: list[torch.Tensor],
    log_probs: list[torch.Tensor] | None,
    ref_log_probs: list[torch.Tensor] | None,
) -> list[torch.Tensor]:
    """The per-token KL that shapes token rewards: ``compute_approx_kl(log_probs, ref_log_probs, --kl-loss-type)``,
    zeros without a reference or with ``--kl-coef 0``."""
    if args.kl_coef != 0 and log_probs is not None and ref_log_probs is not None:
        return [
            ppo_utils.compute_approx_kl(lp, ref, args.kl_loss_type)
            for lp, ref in zip(log_probs, ref_log_probs, strict=True)
        ]
    return [torch.zeros_like(m, dtype=torch.float32) for m in loss_masks]


def compute_advantages_and_returns(
    args: argparse.Namespace,
    rewards: list[float],
    loss_masks: list[torch.Tensor],
    log_probs: list[torch.Tensor] | None,
    ref_log_probs: list[torch.Tensor] | None,
    values: list[torch.Tensor] | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-token advantages and returns for each sample, by ``--advantage-estimator`` (DESIGN.md §6).

    ``rewards`` are already shaped (:func:`shape_rewards`). The KL in token rewards (ppo, reinforce++ and its
    baseline variant) is ``compute_approx_kl(log_probs, ref_log_probs, --kl-loss-type)`` scaled by
    ``--kl-coef``; it is zero without a reference or with ``--kl-coef 0``. ppo needs ``values``; the
    returns are the critic's targets (for the other estimators they equal the advantages).
    """
    r = torch.tensor(rewards, dtype=torch.float32)
    kl = token_kl(args, loss_masks, log_probs, ref_log_probs)
    estimator = args.advantage_estimator
    all_steps = getattr(args, "advantage_time_steps", "loss_mask") == "all"
    if estimator in ("grpo", "gspo"):
        advantages = ppo_utils.get_grpo_returns(r, kl)
    elif estimator == "reinforce_plus_plus":
        advantages = ppo_utils.get_reinforce_plus_plus_returns(
            r, kl, loss_masks, args.kl_coef, args.gamma, all_steps
        )
    elif estimator == "reinforce_plus_plus_baseline":
        advantages = ppo_utils.get_reinforce_plus_plus_baseline_advantages(r, kl, loss_masks, args.kl_coef)
    elif estimator == "ppo":
        if values is None:
            raise ValueError(
                "--advantage-estimator ppo needs the critic's values (critic.compute_values(samples))"
            )
        # all_steps (slime): every response token is a GAE step, with its KL reward and the reward on the last
        steps = [torch.ones_like(m) if all_steps else m for m in loss_masks]
        pairs = [
            ppo_utils.get_advantages_and_returns(
                v, ppo_utils.compute_token_rewards(ri, k, s, args.kl_coef), s, args.gamma, args.lambd
            )
            for ri, k, s, v in zip(r, kl, steps, values, strict=True)
        ]
        return [a for a, _ in pairs], [ret for _, ret in pairs]
    else:
        raise ValueError(f"unknown --advantage-estimator {estimator!r}")
    return advantages, advantages


def slime_custom_advantages(
    fn: Callable[[argparse.Namespace, dict[str, Any]], None],
    args: argparse.Namespace,
    samples: list[Sample],
    rewards: list[float],
    loss_masks: list[torch.Tensor],
    log_probs: list[torch.Tensor] | None,
    ref_log_probs: list[torch.Tensor] | None,
    values: list[torch.Tensor] | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Call a ``--custom-advantage-function-path`` written for slime: ``fn(args, rollout_data)`` fills
    ``rollout_data["advantages"]`` and ``["returns"]`` (per-sample tensors) from slime's keys: ``log_probs``,
    ``ref_log_probs``, ``rewards``, ``values``, ``response_lengths``, ``total_lengths``, ``loss_masks``,
    ``rollout_log_probs`` and ``kl`` (``--kl-loss-type`` KL to the reference; zeros with ``--kl-coef 0``)."""
    kl = token_kl(args, loss_masks, log_probs, ref_log_probs)
    rollout_data: dict[str, Any] = {
        "log_probs": log_probs,
        "ref_log_probs": ref_log_probs,
        "rewards": list(rewards),
        "values": values,
        "response_lengths": [s.response_length for s in samples],
        "total_lengths": [len(s.tokens) for s in samples],
        "loss_masks": loss_masks,
        "rollout_log_probs": [
            torch.tensor(s.rollout_log_probs, dtype=torch.float32)
            if s.rollout_log_probs is not None
            else None
            for s in samples
        ],
        "kl": kl,
    }
    fn(args, rollout_data)
    missing = [key for key in ("advantages", "returns") if key not in rollout_data]
    if missing:
        raise ValueError(
            f"--custom-advantage-function-path {args.custom_advantage_function_path} (slime's fn(args, rollout_data)) "
            f"did not set rollout_data{missing}; it must set both, one tensor per sample"
        )
    return list(rollout_data["advantages"]), list(rollout_data["returns"])


def normalize_advantages(
    advantages: list[torch.Tensor], loss_masks: list[torch.Tensor], group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """``--normalize-advantages``: masked whitening over the whole data-parallel batch (a collective over
    ``group``, the data-parallel ranks; default all ranks).

    Every rank gathers all ranks' advantages and masks, whitens the concatenation with
    ``ppo_utils.masked_whiten`` and keeps its own slice, so the result does not depend on the partitioning.
    """
    lengths = [a.numel() for a in advantages]
    local_adv = torch.cat(advantages) if advantages else torch.zeros(0)
    local_mask = torch.cat(loss_masks) if loss_masks else torch.zeros(0)
    all_adv, all_mask = all_gather_1d(local_adv.float(), group), all_gather_1d(local_mask.float(), group)
    rank = dist.get_rank(group)
    offset = sum(a.numel() for a in all_adv[:rank])
    whitened = ppo_utils.masked_whiten(torch.cat(all_adv), torch.cat(all_mask))
    mine = whitened[offset : offset + local_adv.numel()] * local_mask  # untrained tokens keep advantage 0
    return list(mine.split(lengths))


def postprocess_rollout_data(
    postprocess: Any,
    args: argparse.Namespace,
    rollout_id: int,
    samples: list[Sample],
    rewards: list[float],
    masks: list[torch.Tensor],
    data: dict[str, list[torch.Tensor] | None],
    values: list[torch.Tensor] | None,
) -> list[torch.Tensor]:
    """``--rollout-data-postprocess-path`` ``fn(args, rollout_id, rollout_data)`` (slime), after the log-probs and
    advantages: ``rollout_data`` holds one rank's per-sample lists under slime's keys (``tokens``,
    ``response_lengths``, ``total_lengths``, ``rewards``, ``loss_masks``, ``log_probs``, ``ref_log_probs``,
    ``rollout_log_probs``, ``advantages``, ``values``, ``entropy`` with ``--use-rollout-entropy``) and ``samples``.
    The ``loss_masks`` and ``advantages`` it leaves there are trained on (``data["advantages"]`` is updated);
    returns the loss masks."""
    rollout_data = {
        "samples": samples,
        "tokens": [torch.tensor(s.tokens) for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "total_lengths": [len(s.tokens) for s in samples],
        "rewards": list(rewards),
        "loss_masks": list(masks),
        "log_probs": data["old_log_probs"],
        "ref_log_probs": data["ref_log_probs"],
        "rollout_log_probs": data["rollout_log_probs"],
        "advantages": list(data["advantages"]),
        "values": values,
        "entropy": data.get("rollout_entropy"),
    }
    postprocess(args, rollout_id, rollout_data)
    for key in ("loss_masks", "advantages"):
        got = rollout_data[key]
        if len(got) != len(samples) or any(
            t.shape != (s.response_length,) for t, s in zip(got, samples, strict=True)
        ):
            raise ValueError(
                f"--rollout-data-postprocess-path left rollout_data[{key!r}] in another shape: one tensor of "
                "response_length per sample"
            )
    data["advantages"] = list(rollout_data["advantages"])
    return [m.float() for m in rollout_data["loss_masks"]]
