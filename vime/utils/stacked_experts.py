"""Stacked MoE expert weights: one tensor per MoE layer and projection instead of one per expert, the layout of
vLLM's fused-MoE parameters (``w13_weight``, ``w2_weight``), under keys that are not HF names.

- ``<experts>.vime_stacked_w13`` ``[E, 2I, H]``: expert ``e``'s ``gate_proj`` rows then its ``up_proj`` rows;
- ``<experts>.vime_stacked_w2`` ``[E, H, I]``: expert ``e``'s ``down_proj``;

where ``<experts>`` is the HF module path (``model.layers.3.mlp.experts``), ``E`` every (global) expert, ``I`` the
full (unsharded) MoE intermediate size. :func:`expand_stacked` gives the HF per-expert tensors back, as views.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

W13, W2 = "w13", "w2"
_STACKED = re.compile(r"^(?P<experts>.+)\.vime_stacked_(?P<proj>w13|w2)$")


def stacked_name(experts: str, proj: str) -> str:
    """The key of a stacked tensor: ``experts`` is the HF module path, ``proj`` is ``w13`` or ``w2``."""
    if proj not in (W13, W2):
        raise ValueError(f"stacked expert projection must be {W13!r} or {W2!r}, not {proj!r}")
    return f"{experts}.vime_stacked_{proj}"


def parse_stacked(name: str) -> tuple[str, str] | None:
    """``(experts module path, "w13" | "w2")`` of a stacked key, None for any other name."""
    match = _STACKED.match(name)
    return (match["experts"], match["proj"]) if match else None


def expand_stacked(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` with every stacked tensor replaced by its HF per-expert tensors (views of it, no copy)."""
    for name, tensor in named:
        parsed = parse_stacked(name)
        if parsed is None:
            yield name, tensor
            continue
        experts, proj = parsed
        for e, expert in enumerate(tensor.unbind(0)):
            if proj == W2:
                yield f"{experts}.{e}.down_proj.weight", expert
            else:
                gate, up = expert.chunk(2, dim=0)
                yield f"{experts}.{e}.gate_proj.weight", gate
                yield f"{experts}.{e}.up_proj.weight", up
