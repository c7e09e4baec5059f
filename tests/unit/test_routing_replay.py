"""Routing replay's parts on CPU: the record/replay controller (micro-batch order, recompute inside backward), packing
per-sample arrays into packed rows and back, the rows each Megatron rank's routers see under CP and SP, and the
hook on a Hugging Face Qwen3-MoE router (gate weights from the router's own logits over the replayed experts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from vime.backends.fsdp_utils.routing_replay import attach_routing_replay, router_modules
from vime.backends.megatron_utils.packed_layout import PackedLayout
from vime.utils.routing_replay import MicroBatchRouting, ReplayMode, RoutingReplay
from vime.utils.train_data import pack_routing, pack_samples, split_routing
from vime.utils.types import Sample


# ------------------------------------------------------------------------------------------------ controller
class Router(torch.nn.Module):
    """A stand-in router: top-2 of ``x @ w``, then asks ``replay``; logs (in backward?, chosen) per call."""

    def __init__(self, replay: RoutingReplay, layer: int):
        super().__init__()
        self.replay, self.layer, self.log = replay, layer, []
        self.w = torch.nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(layer)))

    def forward(self, x):
        scores = x @ self.w
        _, own = scores.topk(2, dim=-1)
        chosen = self.replay.choose(self.layer, own)
        self.log.append((torch._C._current_graph_task_id() != -1, chosen.clone()))
        return scores.gather(1, chosen).sum(-1)


def routing(tokens: int, layers: int, fill: int, replayed: list[bool]) -> MicroBatchRouting:
    experts = torch.full((tokens, layers, 2), fill, dtype=torch.int32)
    experts[..., 1] = fill + 1
    return MicroBatchRouting(experts, torch.tensor(replayed))


def test_replay_uses_pushed_experts_on_masked_tokens_and_own_choice_elsewhere():
    replay = RoutingReplay(num_layers=2, topk=2)
    router = Router(replay, layer=1)
    replay.register_layer(1)
    x = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))
    _, own = (x @ router.w).topk(2, dim=-1)
    replay.start(ReplayMode.REPLAY)
    replay.push(routing(3, 2, fill=0, replayed=[True, False, True]))
    router(x)
    replay.stop()
    chosen = router.log[0][1]
    assert chosen[0].tolist() == [0, 1] and chosen[2].tolist() == [0, 1]
    assert torch.equal(chosen[1], own[1])
    router(x)  # off again: the router's own choice
    assert torch.equal(router.log[1][1], own)


def test_record_keeps_each_layers_choice_per_micro_batch():
    replay = RoutingReplay(num_layers=3, topk=2)
    routers = [Router(replay, layer) for layer in (0, 2)]
    for r in routers:
        replay.register_layer(r.layer)
    xs = [torch.randn(n, 3, generator=torch.Generator().manual_seed(n)) for n in (4, 2)]
    replay.start(ReplayMode.RECORD)
    for x in xs:
        replay.push(None)
        for r in routers:
            r(x)
    recorded = replay.recorded()
    replay.stop()
    assert [tuple(t.shape) for t in recorded] == [(4, 3, 2), (2, 3, 2)]
    for i, x in enumerate(xs):
        for r in routers:
            assert torch.equal(recorded[i][:, r.layer].long(), (x @ r.w).topk(2, dim=-1).indices)
        assert not recorded[i][:, 1].any()  # layer 1 has no router


def test_recompute_in_backward_takes_its_own_micro_batch_when_forwards_and_backwards_interleave():
    """A pipeline schedule runs forward 0, forward 1, backward 0, backward 1; with activation checkpointing each
    backward recomputes its router, which must get its own micro-batch's experts again."""
    replay = RoutingReplay(num_layers=1, topk=2)
    router = Router(replay, layer=0)
    replay.register_layer(0)
    xs = [torch.randn(2, 3, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    replay.start(ReplayMode.REPLAY)
    for fill in (0, 2):  # micro-batch 0 replays experts (0, 1), micro-batch 1 (2, 3)
        replay.push(routing(2, 1, fill=fill, replayed=[True, True]))
    losses = [checkpoint(router, x, use_reentrant=False).sum() for x in xs]
    for loss in losses:
        loss.backward()
    replay.stop()
    calls = [(backward, chosen[:, 0].unique().tolist()) for backward, chosen in router.log]
    assert calls == [(False, [0]), (False, [2]), (True, [0]), (True, [2])]


def test_stop_checks_every_hooked_layer_ran_once_per_micro_batch():
    replay = RoutingReplay(num_layers=2, topk=2)
    first, _ = Router(replay, 0), replay.register_layer(1)
    replay.register_layer(0)
    replay.start(ReplayMode.REPLAY)
    replay.push(routing(2, 2, fill=0, replayed=[True, True]))
    first(torch.randn(2, 3))
    with pytest.raises(RuntimeError, match=r"ran \{1: 0\} forwards"):
        replay.stop()
    assert replay.mode is ReplayMode.OFF
    replay.start(ReplayMode.REPLAY)
    with pytest.raises(RuntimeError, match="ran 1 forwards but 0 micro-batches were pushed"):
        first(torch.randn(2, 3))


def test_replay_refuses_a_micro_batch_of_another_size():
    replay = RoutingReplay(num_layers=1, topk=2)
    router = Router(replay, 0)
    replay.register_layer(0)
    replay.start(ReplayMode.REPLAY)
    replay.push(routing(5, 1, fill=0, replayed=[True] * 5))
    with pytest.raises(ValueError, match="sees 3 tokens x top-2 but the replayed micro-batch has 5 tokens"):
        router(torch.randn(3, 3))


# --------------------------------------------------------------------------------------------------- packing
def test_pack_routing_places_each_samples_rows_at_its_packed_positions():
    a = np.arange(4 * 2 * 2, dtype=np.uint8).reshape(4, 2, 2)  # 4 of 5 tokens (the engine's len - 1)
    c = torch.full((2, 2, 2), 7, dtype=torch.uint8)  # a recorded tensor
    packed = pack_routing([a, None, c], [5, 3, 2])
    assert packed.experts.shape == (10, 2, 2)
    assert packed.mask.tolist() == [True] * 4 + [False] * 4 + [True] * 2
    assert torch.equal(packed.experts[:4], torch.from_numpy(a).int())
    assert torch.equal(packed.experts[8:], c.int())
    assert pack_routing([None, None], [2, 3]) is None
    back = split_routing(packed.experts, [5, 3, 2])
    assert [tuple(t.shape) for t in back] == [(5, 2, 2), (3, 2, 2), (2, 2, 2)]
    with pytest.raises(ValueError, match="sample 1 of the micro-batch: routing of shape"):
        pack_routing([a, np.zeros((4, 3, 2), np.uint8)], [5, 5])
    with pytest.raises(ValueError, match="expected at most 3 rows"):
        pack_routing([a], [3])


def test_pack_samples_carries_the_routing_rows_of_its_tokens():
    samples = [Sample(tokens=[1, 2, 3], response_length=1), Sample(tokens=[4, 5, 6, 7], response_length=2)]
    routes = [np.ones((2, 1, 2), np.uint16) * 300, np.zeros((3, 1, 2), np.uint8)]
    packed = pack_samples(samples, routes)
    assert packed.routing.mask.tolist() == [True, True, False, True, True, True, False]
    assert packed.routing.experts[:2].eq(300).all() and packed.routing.experts[3:6].eq(0).all()
    assert pack_samples(samples).routing is None


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("sp", [1, 2])
def test_megatron_local_rows_are_the_tokens_each_rank_sees_and_gather_back(cp, sp):
    lengths = [5, 9, 3, 12, 1]
    input_ids = torch.arange(sum(lengths)) + 100
    experts = torch.stack([input_ids, -input_ids], dim=1).unsqueeze(1)  # [T, 1 layer, 2]
    gathered = []
    for cp_rank in range(cp):
        layout = PackedLayout.for_parallelism(lengths, sp, sp > 1, cp, cp_rank, "cpu")
        model_rows = layout.pad(input_ids)[layout.local_positions]  # what the trainer feeds this CP rank
        slices = [layout.local_rows(experts, sp, tp_rank) for tp_rank in range(sp)]
        for tp_rank, local in enumerate(slices):  # the SP scatter splits the local rows evenly
            size = len(model_rows) // sp
            real = model_rows[tp_rank * size : (tp_rank + 1) * size]
            held = local[:, 0, 0]
            assert torch.equal(held[real != 0], real[real != 0])  # pads are 0 in both
        gathered.append(torch.cat(slices))
    assert torch.equal(layout.from_local_rows(torch.cat(gathered)), experts)


# --------------------------------------------------------------------------------------------- the HF hook
@pytest.fixture
def moe_model():
    from vime.tools.make_tiny_model import VOCAB_SIZE, build_model

    model = build_model(VOCAB_SIZE, seed=0, num_layers=2, num_experts=4, num_experts_per_tok=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    return model.float().eval()


def run_routers(model, input_ids):
    """(logits, weights, experts) that every router of ``model`` returned, by layer."""
    seen = {}
    handles = [
        router.register_forward_hook(lambda m, i, out, layer=layer: seen.__setitem__(layer, out))
        for layer, router in router_modules(model).items()
    ]
    with torch.no_grad():
        logits = model(input_ids).logits
    for h in handles:
        h.remove()
    return logits, seen


def test_hf_router_hook_gates_replayed_experts_from_the_routers_own_logits(moe_model):
    model = moe_model
    input_ids = torch.tensor([[5, 9, 12, 30, 41, 7]])
    own_logits, own = run_routers(model, input_ids)
    replay = RoutingReplay(num_layers=2, topk=2)
    assert attach_routing_replay(model, replay) == [0, 1]
    # the same experts: bitwise the same model output
    same = torch.stack([own[layer][2] for layer in (0, 1)], dim=1)
    replay.start(ReplayMode.REPLAY)
    replay.push(MicroBatchRouting(same, torch.ones(6, dtype=torch.bool)))
    logits, seen = run_routers(model, input_ids)
    replay.stop()
    assert torch.equal(logits, own_logits)
    # the two experts each token did not pick: the output changes; weights = softmax of its logits over them
    forced = torch.stack(
        [
            torch.tensor([[e for e in range(4) if e not in row] for row in own[layer][2].tolist()])
            for layer in (0, 1)
        ],
        dim=1,
    )
    replay.start(ReplayMode.REPLAY)
    replay.push(MicroBatchRouting(forced, torch.ones(6, dtype=torch.bool)))
    logits, seen = run_routers(model, input_ids)
    replay.stop()
    assert not torch.allclose(logits, own_logits)
    for layer in (0, 1):
        router_logits, weights, experts = seen[layer]
        assert torch.equal(experts, forced[:, layer])
        by_hand = torch.exp(router_logits.double())
        by_hand = by_hand.gather(1, experts) / by_hand.gather(1, experts).sum(-1, keepdim=True)
        torch.testing.assert_close(weights.double(), by_hand, rtol=1e-6, atol=0)


def test_router_modules_refuses_routers_it_cannot_replay():
    class MysteryTopKRouter(torch.nn.Module):
        top_k = 2

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].gate = MysteryTopKRouter()
    with pytest.raises(ValueError, match="does not know the gate weights of MysteryTopKRouter"):
        router_modules(model)
    assert router_modules(torch.nn.Linear(2, 2)) == {}
