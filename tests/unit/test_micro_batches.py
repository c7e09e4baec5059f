"""The loss metrics of a step's micro-batches: summed on their device, read once after the step."""

from __future__ import annotations

import pytest
import torch

from vime.backends.micro_batches import add_metrics, metric_sums


class TwoRanks:
    """A data-parallel group whose other rank holds the same sums."""

    def sum(self, values: list[float]) -> list[float]:
        return [2 * v for v in values]


def test_tensor_metrics_stay_tensors_until_the_step_ends():
    sums: dict = {}
    for scale in (1.0, 2.0):
        loss = torch.tensor(0.5 * scale, requires_grad=True) * 1
        add_metrics(sums, {"loss": loss, "clipfrac": torch.tensor(0.25 * scale), "count": 3})
    # a float() per metric and micro-batch made the host wait for the GPU between forward and backward
    assert isinstance(sums["loss"], torch.Tensor) and not sums["loss"].requires_grad
    assert isinstance(sums["clipfrac"], torch.Tensor)
    assert metric_sums(sums, TwoRanks()) == {"clipfrac": pytest.approx(1.5), "count": 12.0, "loss": 3.0}


def test_no_micro_batch_metrics_give_no_sums():
    assert metric_sums({}, TwoRanks()) == {}
