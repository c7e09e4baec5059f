"""Interleaved rounds of timed batches: every side runs one batch per round, in an order rotated from round to
round, so drift on a shared machine spreads over all sides instead of landing on whichever ran last; ratios are
taken within a round and summarised over the rounds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

# Fewer rounds give no usable spread: ratios of medians over 1-3 batches per side read 0.83 and 1.11 in two runs of
# one workload (bench/README.md).
MIN_ROUNDS = 5


def rotated_order(sides: list[str], round_index: int) -> list[str]:
    """``sides`` rotated left by ``round_index``: over ``len(sides)`` rounds each side runs once in each place."""
    shift = round_index % len(sides)
    return sides[shift:] + sides[:shift]


def run_rounds(
    batches: dict[str, Callable[[], float]],
    rounds: int,
    report: Callable[[str, int, float], None],
    after_round: Callable[[dict[str, list[float]]], None] | None = None,
    deadline: float | None = None,
) -> dict[str, list[float]]:
    """One untimed warm-up batch per side, then ``rounds`` rounds of one batch per side in :func:`rotated_order`;
    each batch returns its tokens/s, handed to ``report(side, round, rate)`` (round -1: the warm-up). The rates of
    each side, in round order, handed to ``after_round`` after every round too (to save them as they come). With a
    ``deadline`` (``time.monotonic()``), no round starts that would end after it at the pace of the slowest round so
    far (the warm-up counts as one), so the rounds done are kept where a time limit would lose them."""
    started = time.monotonic()
    for side, batch in batches.items():
        report(side, -1, batch())
    slowest = time.monotonic() - started
    rates: dict[str, list[float]] = {side: [] for side in batches}
    for round_index in range(rounds):
        if deadline is not None and time.monotonic() + slowest > deadline:
            print(
                f"[bench] stopping after {round_index} of {rounds} rounds: the next would pass the time limit"
            )
            break
        started = time.monotonic()
        for side in rotated_order(list(batches), round_index):
            rates[side].append(batches[side]())
            report(side, round_index, rates[side][-1])
        slowest = max(slowest, time.monotonic() - started)
        if after_round is not None:
            after_round(rates)
    return rates


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratio_summary(numerator: list[float], denominator: list[float]) -> dict:
    """The per-round ratios ``numerator[i] / denominator[i]`` and their :func:`spread`."""
    if len(numerator) != len(denominator):
        raise ValueError(f"{len(numerator)} rates over {len(denominator)}: the sides ran different rounds")
    per_round = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return spread(per_round) | {"per_round": per_round}


def verdict(label: str, summary: dict) -> str:
    """``label = median (min-max over n rounds)`` of a :func:`ratio_summary`."""
    rounds = len(summary["per_round"])
    return (
        f"{label} = {summary['median']:.2f} ({summary['min']:.2f}-{summary['max']:.2f} over {rounds} rounds)"
    )
