"""The shared engine pool (``tests/e2e/conftest.py``): whatever a test leaves in a pooled engine, the next user gets the
checkpoint's weights back, unpaused, so pooled tests do not depend on their order. Adds no engine start."""

from __future__ import annotations

import pytest
import torch
from conftest import PROBE_TOKENS
from transformers import AutoModelForCausalLM

from vime.backends.vllm_utils.control_client import EngineGroup

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_the_next_user_of_a_pooled_engine_sees_the_base_log_probs(engine_pool, tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(tmp_path / "perturbed")
    urls, name = engine_pool.urls, str(tiny_model_dir)

    async def leave_a_mess(engine):
        await engine.reload_weights(str(tmp_path / "perturbed"))
        await engine.prompt_log_probs(name, PROBE_TOKENS)  # cached under the perturbed weights
        await engine.pause(mode="keep")

    with EngineGroup(urls) as engines:
        engines.run(leave_a_mess)
        assert engines.run(lambda engine: engine.is_paused()) == [True] * len(urls)
        engines.run(lambda engine: engine.resume())
        changed = engines.run(lambda engine: engine.prompt_log_probs(name, PROBE_TOKENS))
        engines.run(lambda engine: engine.pause(mode="keep"))
    assert all(
        max(abs(a - b) for a, b in zip(got, base, strict=True)) > 1e-3
        for got, base in zip(changed, engine_pool.base_log_probs, strict=True)
    ), "the perturbed weights did not reach the engines"

    engine_pool.reset()  # what the next test's engine_pool fixture does
    with EngineGroup(urls) as engines:
        assert engines.run(lambda engine: engine.is_paused()) == [False] * len(urls)
        again = engines.run(lambda engine: engine.prompt_log_probs(name, PROBE_TOKENS))
    assert again == engine_pool.base_log_probs
