"""``--rollout-sample-seeds``: requests carry a per-sample sampling seed only when asked (vLLM draws seeded
requests' noise one request at a time, a throughput cost), and the flag is refused with CPU engines."""

from __future__ import annotations

import asyncio
import types

import pytest

from vime.rollout import vllm_generate
from vime.rollout.rollout_manager import RolloutManager
from vime.rollout.vllm_generate import generate, generate_fresh_group, sample_seed
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils.arguments import parse_args
from vime.utils.run_context import RunContext
from vime.utils.types import Sample, Status


class RecordingRouter:
    """A rollout context that records each completion body and answers one 1-token choice per sample."""

    def __init__(self):
        self.payloads: list[dict] = []
        self.semaphore = asyncio.Semaphore(4)
        self.aborting = False
        self.retry_window_s = 0.0
        self.requeued_samples = 0
        self.run = RunContext(weight_version=0)

    async def completion(self, payload, engine_url=None):
        self.payloads.append(payload)
        choice = {
            "token_ids": [9],
            "logprobs": {"token_logprobs": [-0.5]},
            "text": "x",
            "finish_reason": "length",
        }
        return {"choices": [{**choice, "index": i} for i in range(payload.get("n", 1))]}


def _group(size: int, first_index: int) -> list[Sample]:
    return [Sample(index=first_index + i, tokens=[5, 6, 7]) for i in range(size)]


@pytest.mark.parametrize("seeded", [False, True])
def test_requests_carry_a_seed_only_with_the_flag(monkeypatch, seeded):
    ctx = RecordingRouter()
    monkeypatch.setattr(vllm_generate, "get_context", lambda args, run_context: ctx)
    args = types.SimpleNamespace(
        hf_checkpoint="m", rollout_seed=42, rollout_sample_seeds=seeded, rollout_max_context_len=None,
        use_rollout_routing_replay=False, use_score_centering=False,
    )  # fmt: skip
    params = {"max_tokens": 4, "temperature": 1.0}

    async def main() -> None:
        group = await generate_fresh_group(args, _group(4, first_index=8), params)
        single = await generate(args, _group(1, first_index=13)[0], params)
        assert all(s.status == Status.TRUNCATED for s in [*group, single])

    asyncio.run(main())
    group_body, single_body = ctx.payloads
    assert group_body["n"] == 4
    if seeded:  # the group's seed is its first sample's; vLLM seeds its n children seed, seed + 1, ...
        assert group_body["seed"] == sample_seed(args, Sample(index=8))
        assert single_body["seed"] == sample_seed(args, Sample(index=13)) != group_body["seed"]
    else:
        assert "seed" not in group_body and "seed" not in single_body


def test_the_flag_is_refused_with_cpu_engines(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model", seed=0, num_train=8)
    args = parse_args(
        [
            "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--prompt-data",
            str(model_dir / "train.jsonl"), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--num-rollout", "1", "--rollout-sample-seeds",
        ]
    )  # fmt: skip
    manager = RolloutManager(args, tmp_path / "logs")
    with pytest.raises(ValueError, match="--rollout-sample-seeds needs GPU engines"):
        manager.start()
    assert manager.engines == []
