"""slime's context-parallel helpers for loss plug-ins (``slime.backends.megatron_utils.cp_utils``), under vime's
loss contract.

In slime a CP rank's loss sees only its share of each response (two chunks of the zig-zag split), and a plug-in
such as the train-inference mismatch helper gathers the full response with :func:`all_gather_with_cp`, computes on
it, and cuts its share back out with :func:`slice_log_prob_with_cp`. vime's Megatron trainer all-gathers the
log-probs over CP before the loss (every CP rank computes the same loss on whole responses), and the FSDP trainer has
no CP, so a loss plug-in already holds whole responses: its share is the whole response, and both helpers hand it
back as it is, after checking it is one. Importable without Megatron (no CP group is needed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _check_whole(values: Sequence | torch.Tensor, total_length: int, response_length: int, name: str) -> None:
    if len(values) != response_length:
        raise ValueError(
            f"{name}: {len(values)} values for a response of {response_length} tokens (total {total_length}); vime "
            "hands loss plug-ins whole responses on every CP rank, so pass one response's per-token values"
        )


def all_gather_with_cp(tensor: torch.Tensor, total_length: int, response_length: int) -> torch.Tensor:
    """The whole response's per-token values from this CP rank's share: in vime the share is the whole response
    (first dimension ``response_length``), returned as it is."""
    _check_whole(tensor, total_length, response_length, "all_gather_with_cp")
    return tensor


def slice_log_prob_with_cp(
    log_prob: list[float] | torch.Tensor, total_length: int, response_length: int
) -> list[float] | torch.Tensor:
    """This CP rank's share of a whole response's per-token values: in vime every CP rank's loss works on the whole
    response, so the share is all of it, returned as it is."""
    _check_whole(log_prob, total_length, response_length, "slice_log_prob_with_cp")
    return log_prob
