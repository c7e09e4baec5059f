"""vime's hook on Megatron-Core's ``TopKRouter`` (needs megatron-core; the router runs on the CPU): the replayed
experts reach Megatron's routing map, and its gate weights come from the router's own logits over them for each
score function (softmax over the top-k as in Qwen3-MoE, softmax before top-k, sigmoid with top-k scaling)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from vime.backends.megatron_utils.routing_replay import attach_routing_replay  # noqa: E402
from vime.utils.routing_replay import MicroBatchRouting, ReplayMode, RoutingReplay  # noqa: E402

SCORES = {
    "softmax": dict(),
    "pre_softmax": dict(moe_router_pre_softmax=True),
    "sigmoid_scaled": dict(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5),
    # DeepSeek-V3: the expert bias and the best groups choose the experts; the bias-free scores weigh them
    "sigmoid_grouped_bias": dict(
        moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=2.5,
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=3,
        moe_router_group_topk=1,
    ),
}


def make_router(layer_number: int, **config) -> TopKRouter:
    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=6, moe_router_topk=2,
        moe_router_load_balancing_type="none", moe_token_dispatcher_type="alltoall", **config,
    )  # fmt: skip
    groups = SimpleNamespace(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)
    router = TopKRouter(config, pg_collection=groups)
    router.set_layer_number(layer_number)
    return router


def by_hand(logits: torch.Tensor, experts: torch.Tensor, kind: str) -> torch.Tensor:
    """Megatron's gate weights of ``experts`` from ``logits``, written out for each score function."""
    if kind == "softmax":
        return torch.softmax(logits.gather(1, experts), dim=-1)
    if kind == "pre_softmax":
        return torch.softmax(logits, dim=-1).gather(1, experts)
    chosen = torch.sigmoid(logits).gather(1, experts)  # the expert bias never weighs
    return 2.5 * chosen / (chosen.sum(-1, keepdim=True) + 1e-20)


@pytest.mark.parametrize("kind", sorted(SCORES))
def test_megatron_router_replays_experts_with_weights_from_its_own_logits(kind, monkeypatch):
    if not torch.cuda.is_available():  # Megatron puts the expert-bias buffers on the current CUDA device
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    router = make_router(layer_number=2, **SCORES[kind])
    if router.expert_bias is not None:
        router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0, -0.1, 0.2]))
    replay = RoutingReplay(num_layers=2, topk=2)
    module = torch.nn.ModuleDict({"router": router})
    assert attach_routing_replay(module, replay) == [1]  # Megatron numbers layers from 1
    logits = torch.randn(7, 6, generator=torch.Generator().manual_seed(0))
    own_probs, own_map = router.routing(logits.clone())
    own = own_map.nonzero()[:, 1].view(7, 2)

    replay.start(ReplayMode.REPLAY)  # replaying its own choice changes nothing
    replay.push(MicroBatchRouting(torch.stack([own, own], dim=1), torch.ones(7, dtype=torch.bool)))
    probs, routing_map = router.routing(logits.clone())
    replay.stop()
    assert torch.equal(probs, own_probs) and torch.equal(routing_map, own_map)

    forced = torch.tensor([[(a + 2) % 6, (b + 2) % 6] for a, b in own.tolist()])  # never its own experts
    keep_own = torch.tensor([True] * 6 + [False])  # the last token routes on its own choice
    replay.start(ReplayMode.REPLAY)
    replay.push(MicroBatchRouting(torch.stack([forced, forced], dim=1), keep_own))
    probs, routing_map = router.routing(logits.clone())
    replay.stop()
    want_map = torch.zeros(7, 6, dtype=torch.bool).scatter(1, forced, True)
    want_map[6] = own_map[6]
    assert torch.equal(routing_map, want_map)
    weights = probs[:6].gather(1, forced[:6])
    torch.testing.assert_close(weights, by_hand(logits[:6], forced[:6], kind), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(probs[6], own_probs[6])


def test_megatron_router_records_its_choice():
    router = make_router(layer_number=1)
    replay = RoutingReplay(num_layers=2, topk=2)
    attach_routing_replay(torch.nn.ModuleDict({"router": router}), replay)
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    replay.start(ReplayMode.RECORD)
    replay.push(None)
    _, routing_map = router.routing(logits)
    (recorded,) = replay.recorded()
    replay.stop()
    assert torch.equal(
        torch.zeros(5, 6, dtype=torch.bool).scatter(1, recorded[:, 0].long(), True), routing_map
    )


def test_fused_routing_is_refused():
    router = make_router(layer_number=1)
    router.config.moe_router_fusion = True
    with pytest.raises(ValueError, match="needs Megatron's unfused top-k routing"):
        attach_routing_replay(torch.nn.ModuleDict({"router": router}), RoutingReplay(2, 2))
