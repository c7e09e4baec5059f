"""``--freeze-params-name-list`` / ``--only-train-params-name-list`` (slime): which parameters train, by regex on
their names (``re.search``; the backend's names: Hugging Face names with FSDP, Megatron's with Megatron)."""

from __future__ import annotations

import re

from torch import nn


def apply_trainable_patterns(
    module: nn.Module, freeze: list[str] | None, only_train: list[str] | None
) -> int:
    """Freeze the parameters of ``module`` that match a ``freeze`` pattern, or that match no ``only_train``
    pattern; returns how many parameters were frozen. A pattern that matches no parameter is an error (a typo
    would otherwise train everything)."""
    names = [name for name, _ in module.named_parameters()]
    for flag, patterns in (
        ("--freeze-params-name-list", freeze),
        ("--only-train-params-name-list", only_train),
    ):
        for pattern in patterns or []:
            if not any(re.search(pattern, name) for name in names):
                raise ValueError(
                    f"{flag} {pattern!r} matches no parameter; names look like {names[:3]} ... {names[-2:]}"
                )
    frozen = 0
    for name, param in module.named_parameters():
        keep = not any(re.search(p, name) for p in freeze or [])
        if only_train:
            keep = keep and any(re.search(p, name) for p in only_train)
        if not keep and param.requires_grad:
            param.requires_grad_(False)
            frozen += 1
    return frozen
