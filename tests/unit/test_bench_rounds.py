"""``bench/rounds.py``: the sides of ``bench/rollout_throughput.py`` run interleaved, one batch per side per round in
an order rotated each round, and its ratios are per-round ratios summarised over the rounds."""

from __future__ import annotations

import pytest

from bench.rounds import ratio_summary, rotated_order, run_rounds, verdict

SIDES = ["offline", "direct", "direct_via_router", "vime"]


def test_each_side_takes_each_place_once_over_as_many_rounds_as_sides():
    orders = [rotated_order(SIDES, r) for r in range(len(SIDES))]
    assert orders[0] == SIDES
    assert orders[1] == ["direct", "direct_via_router", "vime", "offline"]
    for place in range(len(SIDES)):
        assert sorted(order[place] for order in orders) == sorted(SIDES)
    assert rotated_order(SIDES, len(SIDES)) == SIDES  # round 5 starts over


def test_rounds_warm_up_each_side_once_then_run_every_side_per_round_rotated():
    ran, reported = [], []

    def batch(side: str):
        def run() -> float:
            ran.append(side)
            return float(len(ran))  # the batch's place in the whole run, as its rate

        return run

    rates = run_rounds({side: batch(side) for side in SIDES[:3]}, 3, lambda *line: reported.append(line))
    assert ran == [
        "offline", "direct", "direct_via_router",  # warm-up
        "offline", "direct", "direct_via_router",
        "direct", "direct_via_router", "offline",
        "direct_via_router", "offline", "direct",
    ]  # fmt: skip
    assert rates == {
        "offline": [4.0, 9.0, 11.0],
        "direct": [5.0, 7.0, 12.0],
        "direct_via_router": [6.0, 8.0, 10.0],
    }
    assert reported[:3] == [("offline", -1, 1.0), ("direct", -1, 2.0), ("direct_via_router", -1, 3.0)]
    assert reported[3:6] == [("offline", 0, 4.0), ("direct", 0, 5.0), ("direct_via_router", 0, 6.0)]
    assert len(reported) == 12


def test_the_ratio_is_the_median_of_per_round_ratios_not_a_ratio_of_medians():
    # a slow round hits both sides alike: per round vime is 0.9 of offline throughout
    vime = [90.0, 45.0, 99.0, 81.0, 180.0]
    offline = [100.0, 50.0, 110.0, 90.0, 200.0]
    summary = ratio_summary(vime, offline)
    assert summary["per_round"] == pytest.approx([0.9] * 5)
    assert (summary["median"], summary["min"], summary["max"]) == pytest.approx((0.9, 0.9, 0.9))
    summary = ratio_summary([100.0, 60.0, 90.0], [100.0, 50.0, 120.0])  # the medians' ratio: 90 / 100
    assert (summary["median"], summary["min"], summary["max"]) == pytest.approx((1.0, 0.75, 1.2))
    assert verdict("vime / offline", summary) == "vime / offline = 1.00 (0.75-1.20 over 3 rounds)"


def test_sides_that_ran_different_rounds_have_no_ratio():
    with pytest.raises(ValueError, match="different rounds"):
        ratio_summary([1.0, 2.0], [1.0])


def test_rounds_are_handed_over_as_they_end_and_none_starts_past_the_deadline(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("bench.rounds.time.monotonic", lambda: clock[0])

    def batch() -> float:
        clock[0] += 10.0  # every batch takes 10 s
        return 1.0

    saved = []
    # warm-up of two sides: 20 s (ends at 120); each round 20 s: rounds end at 140, 160, 180; 200 > 190
    rates = run_rounds(
        {"offline": batch, "vime": batch}, 9, lambda *_: None, lambda r: saved.append(len(r["vime"])), 190.0
    )
    assert rates == {"offline": [1.0] * 3, "vime": [1.0] * 3}
    assert saved == [1, 2, 3]
    assert run_rounds({"offline": batch}, 2, lambda *_: None) == {"offline": [1.0, 1.0]}  # no deadline
