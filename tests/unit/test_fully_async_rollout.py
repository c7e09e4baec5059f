"""The fully-async rollout's worker with a fake engine whose groups finish when the test says: the staleness bound
(stale groups are generated again, never trained), admission (no group starts that would be too stale), weight
syncs (no request starts during one), the dynamic filter, aborted groups, errors, stop, and checkpoints that
neither lose nor repeat a prompt."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from vime.rollout import fully_async_rollout
from vime.rollout.data_source import RolloutDataSource
from vime.rollout.filter_hub.base_types import DynamicFilterOutput
from vime.rollout.fully_async_rollout import FullyAsyncWorker
from vime.rollout.vllm_rollout import RolloutError
from vime.utils.data import PromptDataset
from vime.utils.run_context import RunContext
from vime.utils.types import Sample, Status

B = 2  # groups per rollout


def make_args(**overrides) -> argparse.Namespace:
    values = dict(
        prompt_data="prompts.jsonl", rollout_seed=1, rollout_shuffle=False, n_samples_per_prompt=2,
        rollout_batch_size=B, over_sampling_batch_size=None, max_staleness=1, rollout_concurrency=64,
        partial_rollout=False,
        dynamic_sampling_filter_path=None, rollout_sample_filter_path=None, rollout_all_samples_process_path=None,
        rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1, rollout_max_response_len=4,
        rollout_stop=None, rollout_stop_token_ids=None, reward_key=None, log_passrate=False, use_score_centering=False,
    )  # fmt: skip
    return argparse.Namespace(**{**values, **overrides})


def make_run() -> RunContext:
    """One engine, serving weight version 1."""
    return RunContext(engine_urls=["http://e0"], weight_version=1)


def make_source(args, num_prompts: int = 40) -> RolloutDataSource:
    prompts = [Sample(index=i, prompt=f"p{i}", tokens=[i, 1]) for i in range(num_prompts)]
    return RolloutDataSource(args, tokenizer=None, dataset=PromptDataset(samples=prompts))


class FakeEngine:
    """Generates a group when the test finishes it; stamps the weight version the request was sent at."""

    def __init__(self):
        self.waiting: dict[int, asyncio.Future] = {}  # group_index -> until finished
        self.started: list[tuple[int, int]] = []  # (group_index, weight version)
        self.outcome: dict[int, object] = {}  # group_index -> Status.ABORTED or an exception, once

    async def __call__(self, args, group, sampling_params, rollout_id, *, run_context):
        key = group[0].group_index
        version = run_context.weight_version
        self.started.append((key, version))
        self.waiting[key] = asyncio.get_running_loop().create_future()
        await self.waiting[key]
        outcome = self.outcome.pop(key, Status.COMPLETED)
        if isinstance(outcome, Exception):
            raise outcome
        for sample in group:
            sample.append_response_tokens(tokens=[7], log_probs=[-0.5])
            sample.weight_versions.append(version)
            sample.status, sample.reward = outcome, float(key % 2)
        return group

    async def finish(self, *keys: int) -> None:
        for key in keys:
            self.waiting.pop(key).set_result(None)
        await settle()


async def settle() -> None:
    """Let every task that can run, run."""
    for _ in range(20):
        await asyncio.sleep(0)


def prompts(output) -> list[int]:
    return [group[0].metadata["prompt_index"] for group in output.samples]


async def sync(worker: FullyAsyncWorker) -> None:
    """A weight sync as the manager drives it."""
    await worker.pause()
    worker.run.weight_version += 1
    await worker.resume()
    await settle()


def test_a_group_too_stale_for_its_rollout_is_generated_again_and_no_trained_sample_exceeds_the_bound():
    async def scenario():
        args = make_args(max_staleness=1)  # train.py's loop: each rollout trains on the engines' version
        engine, source = FakeEngine(), make_source(args)
        worker = FullyAsyncWorker(args, source, make_run(), generate=engine)
        first = asyncio.ensure_future(worker.next_batch(0, train_version=1))
        await settle()
        # 2 groups for rollout 0 and 2 for rollout 1 (lag 1 there); a third rollout ahead would lag 2
        assert sorted(engine.waiting) == [0, 1, 2, 3]
        await engine.finish(0, 2)
        out0 = await first
        assert prompts(out0) == [0, 2] and out0.metrics["fully_async/staleness_max"] == 0
        assert sorted(engine.waiting) == [1, 3]
        await sync(worker)  # version 2: room for two more groups (lag 1 at rollout 2)
        assert sorted(engine.waiting) == [1, 3, 4, 5] and engine.started[-1] == (5, 2)
        second = asyncio.ensure_future(worker.next_batch(1, train_version=2))
        await engine.finish(3, 4)
        out1 = await second
        assert prompts(out1) == [3, 4] and out1.metrics["fully_async/staleness_max"] == 1
        await sync(worker)  # version 3: group 1, started at version 1, now lags 2
        third = asyncio.ensure_future(worker.next_batch(2, train_version=3))
        await engine.finish(1)
        assert engine.started[-1] == (1, 3)  # drawn again from its prompt, at the current version
        await engine.finish(5, 1)
        out2 = await third
        assert sorted(prompts(out2)) == [1, 5]
        assert out2.metrics["fully_async/regenerated_groups"] == 1
        assert out2.metrics["fully_async/staleness_samples/1"] == 2  # group 5's samples
        assert out2.metrics["fully_async/staleness_samples/0"] == 2  # group 1's, generated again
        for out, train_version in ((out0, 1), (out1, 2), (out2, 3)):
            for sample in (s for group in out.samples for s in group):
                assert 0 <= train_version - min(sample.weight_versions) <= 1
                assert sample.response_length == 1 and len(sample.weight_versions) == 1

    asyncio.run(scenario())


def test_one_step_ahead_loop_starts_nothing_that_would_lag_past_the_bound():
    async def scenario():
        # train_async.py: rollout r is generated at version v and trained at v + 1
        args = make_args(max_staleness=1)
        engine, source = FakeEngine(), make_source(args)
        worker = FullyAsyncWorker(args, source, make_run(), generate=engine)
        first = asyncio.ensure_future(worker.next_batch(0, train_version=1))
        await settle()
        await engine.finish(*sorted(engine.waiting))
        await first
        second = asyncio.ensure_future(worker.next_batch(1, train_version=2))
        await settle()
        await engine.finish(*sorted(engine.waiting))
        out = await second
        assert out.metrics["fully_async/staleness_max"] == 1
        assert worker.in_flight == {}  # a group started now, at version 1, would train at 3 at the earliest
        await sync(worker)
        assert len(worker.in_flight) == B  # at version 2 it trains at 3: lag 1

    asyncio.run(scenario())


def test_a_bound_the_loop_cannot_meet_is_refused():
    async def scenario():
        args = make_args(max_staleness=0)
        run = make_run()
        worker = FullyAsyncWorker(args, make_source(args), run, generate=FakeEngine())
        with pytest.raises(RolloutError, match="needs --max-staleness >= 1"):
            await worker.next_batch(1, train_version=run.weight_version + 1)

    asyncio.run(scenario())


def test_no_request_starts_during_a_weight_sync():
    async def scenario():
        args = make_args(max_staleness=2)
        engine, source = FakeEngine(), make_source(args)
        worker = FullyAsyncWorker(args, source, make_run(), generate=engine)
        first = asyncio.ensure_future(worker.next_batch(0, train_version=1))
        await settle()
        await engine.finish(0, 1)
        await first
        started = len(engine.started)
        await worker.pause()
        await engine.finish(2)  # room frees up, but the weights are changing
        assert len(engine.started) == started
        worker.run.weight_version = 2
        await worker.resume()
        await settle()
        assert len(engine.started) > started and all(v == 2 for _, v in engine.started[started:])

    asyncio.run(scenario())


def test_surplus_groups_wait_for_the_next_rollout_in_finishing_order():
    async def scenario():
        args = make_args(max_staleness=2)
        engine, source = FakeEngine(), make_source(args)
        worker = FullyAsyncWorker(args, source, make_run(), generate=engine)
        first = asyncio.ensure_future(worker.next_batch(0, train_version=1))
        await settle()
        await engine.finish(5, 3, 0, 1)
        assert prompts(await first) == [3, 5]  # the first two to finish, sorted by index
        assert [group.drawn[0].group_index for group in worker.ready] == [0, 1]
        out = await worker.next_batch(1, train_version=1)
        assert prompts(out) == [0, 1] and out.metrics["fully_async/ready_groups"] == 0

    asyncio.run(scenario())


def keep_even(args, group) -> DynamicFilterOutput:
    return DynamicFilterOutput(keep=group[0].metadata["prompt_index"] % 2 == 0, reason="odd")


def test_groups_the_dynamic_filter_drops_are_counted_and_never_trained():
    async def scenario():
        args = make_args(dynamic_sampling_filter_path=f"{__name__}.keep_even", max_staleness=2)
        engine, source = FakeEngine(), make_source(args)
        worker = FullyAsyncWorker(args, source, make_run(), generate=engine)
        batch = asyncio.ensure_future(worker.next_batch(0, train_version=1))
        await settle()
        while not batch.done():
            await engine.finish(min(engine.waiting))
        out = await batch
        assert prompts(out) == [0, 2] and out.metrics["rollout/dropped_groups/odd"] == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("partial", [False, True])
def test_an_aborted_group_goes_back_to_the_buffer(partial):
    async def scenario():
        args = make_args(partial_rollout=partial, max_staleness=2)
        engine, source = FakeEngine(), make_source(args)
        worker = FullyAsyncWorker(args, source, make_run(), generate=engine)
        engine.outcome[0] = Status.ABORTED
        batch = asyncio.ensure_future(worker.next_batch(0, train_version=1))
        await settle()
        await engine.finish(0)
        assert source.buffer_size == 0  # drawn again at once
        assert engine.started[-1][0] == 0
        resumed_from = worker.in_flight[next(reversed(worker.in_flight))].drawn[0]
        assert resumed_from.response_length == (1 if partial else 0)
        await engine.finish(1, 0)
        out = await batch
        assert sorted(prompts(out)) == [0, 1] and out.metrics["fully_async/aborted_groups"] == 1

    asyncio.run(scenario())


def test_a_failing_group_fails_the_rollout_waiting_for_it():
    async def scenario():
        args = make_args()
        engine = FakeEngine()
        worker = FullyAsyncWorker(args, make_source(args), make_run(), generate=engine)
        engine.outcome[0] = RuntimeError("router gone")
        batch = asyncio.ensure_future(worker.next_batch(0, train_version=1))
        await settle()
        await engine.finish(0)
        with pytest.raises(RolloutError, match="router gone"):
            await batch
        await worker.stop()

    asyncio.run(scenario())


def test_stop_cancels_the_requests_in_flight_and_starts_no_more():
    async def scenario():
        args = make_args()
        engine = FakeEngine()
        worker = FullyAsyncWorker(args, make_source(args), make_run(), generate=engine)
        batch = asyncio.ensure_future(worker.next_batch(0, train_version=1))
        await settle()
        waiting = list(engine.waiting.values())
        await worker.stop()
        assert all(future.cancelled() for future in waiting) and worker.in_flight == {}
        with pytest.raises(RolloutError, match="stopped"):
            await batch
        await sync(worker)
        assert worker.in_flight == {}

    asyncio.run(scenario())


def test_a_checkpoint_holds_every_drawn_untrained_group_as_a_prompt():
    """Trained groups + the saved buffer = every group ever drawn, each once; a resumed source serves the
    untrained ones first, reset to their prompts."""

    async def scenario():
        args = make_args(max_staleness=2)
        engine, source = FakeEngine(), make_source(args)
        worker = FullyAsyncWorker(args, source, make_run(), generate=engine)
        trained = []
        for rollout_id in range(3):
            batch = asyncio.ensure_future(worker.next_batch(rollout_id, train_version=1 + rollout_id))
            await settle()
            await engine.finish(*sorted(engine.waiting)[:3])  # one finished group stays ready
            trained += [group[0].group_index for group in (await batch).samples]
            await sync(worker)
        await worker.pause()  # so that an aborted group stays in the source's own buffer
        engine.outcome[max(engine.waiting)] = Status.ABORTED
        await engine.finish(max(engine.waiting))
        assert source.buffer_size == 1
        state = await worker.state_dict()
        return trained, state, source

    trained, state, source = asyncio.run(scenario())
    held = [group[0]["group_index"] for group in state["buffer"]]
    assert held and not set(trained) & set(held)
    assert sorted(trained + held) == list(range(state["next_group_index"]))
    resumed = make_source(make_args())
    resumed.load_state_dict(state)
    again = resumed.get_samples(len(held))
    assert [group[0].group_index for group in again] == sorted(held)
    for sample in (s for group in again for s in group):
        assert (
            sample.response_length == 0 and sample.weight_versions == [] and sample.status == Status.PENDING
        )
        assert sample.tokens == [sample.metadata["prompt_index"], 1]
    assert resumed.get_samples(1)[0][0].group_index == state["next_group_index"]
    assert (
        source.buffer[0][0].status == Status.PENDING and source.next_group_index == state["next_group_index"]
    )


def test_lifecycle_hooks_are_no_ops_without_a_worker():
    args = make_args()
    source = make_source(args)
    rollout = fully_async_rollout.FullyAsyncRollout(args, source)
    rollout.before_weight_update()
    rollout.after_weight_update(2)
    rollout.stop()
    assert rollout.state_dict() == {} and rollout.worker is None


# -- through the rollout manager (no engines: groups finish at once) -----------------------------------------------


async def instant_group(args, group, sampling_params, rollout_id, *, run_context):
    for sample in group:
        sample.append_response_tokens(tokens=[5], log_probs=[-1.0])
        sample.weight_versions.append(run_context.weight_version)
        sample.status, sample.reward = Status.COMPLETED, 1.0
    return group


@pytest.fixture(scope="module")
def manager_args(tmp_path_factory):
    from vime.tools.make_tiny_model import build_tiny_model
    from vime.utils.arguments import parse_args

    model_dir = build_tiny_model(tmp_path_factory.mktemp("m") / "model", seed=0, num_train=40)
    return parse_args(
        [
            "--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--prompt-data",
            str(model_dir / "train.jsonl"), "--rollout-shuffle", "--rollout-batch-size", "3",
            "--n-samples-per-prompt", "2", "--num-rollout", "10", "--max-staleness", "1",
            "--rollout-function-path", "vime.rollout.fully_async_rollout.generate_rollout",
        ]
    )  # fmt: skip


def test_manager_checkpoint_of_a_one_step_ahead_loop_loses_and_repeats_no_prompt(
    manager_args, tmp_path, monkeypatch
):
    """train_async.py's order: rollout 2 is taken before rollout 1's checkpoint; the weights change in between."""
    from vime.rollout.rollout_manager import RolloutManager

    monkeypatch.setattr(fully_async_rollout, "generate_group", instant_group)
    manager = RolloutManager(manager_args, tmp_path / "logs")
    try:
        # each rollout trains on one weight version more than the engines serve while it is generated
        trained = [manager.generate(0), manager.generate(1, weights_ahead=True)]
        manager.before_weight_update()
        manager.set_weight_version(1)
        upcoming = manager.generate(2, weights_ahead=True)
        manager.save(1, tmp_path / "ckpt")
        worker = manager.functions.rollout.worker
        lags = [r.metrics["fully_async/staleness_max"] for r in (*trained, upcoming)]
        assert lags == [0, 1, 1]
    finally:
        manager.shutdown()
    assert worker.stopped and not worker.in_flight

    resumed_manager = RolloutManager(manager_args, tmp_path / "resumed_logs")
    resumed_manager.load(1, tmp_path / "ckpt")
    resumed = resumed_manager.data_source
    default_rollout = argparse.Namespace(
        **{**vars(manager_args), "rollout_function_path": "vime.rollout.vllm_rollout.generate_rollout"}
    )
    with pytest.raises(ValueError, match="does not load"):  # it would drop the held groups
        RolloutManager(default_rollout, tmp_path / "default_logs").load(1, tmp_path / "ckpt")
    done = [group[0].group_index for output in trained for group in output.samples]
    held = [group[0].group_index for group in resumed.buffer]
    assert sorted(done + held) == list(range(resumed.next_group_index))
    assert {group[0].group_index for group in upcoming.samples} <= set(held)  # rollout 2 is generated again


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--max-staleness", "1"], "--max-staleness bounds the fully-async rollout only"),
        (["--rollout-function-path", fully_async_rollout.__name__ + ".generate_rollout", "--colocate"], "drop --colocate"),
        (
            ["--rollout-function-path", fully_async_rollout.__name__ + ".generate_rollout_fully_async", "--max-staleness", "-1"],
            "--max-staleness -1: must be >= 0",
        ),
    ],
)  # fmt: skip
def test_parse_time_refusals(extra, expected, capsys):
    from vime.utils.arguments import parse_args

    base = "--train-backend fsdp --hf-checkpoint /m --prompt-data /d.jsonl --rollout-batch-size 4 --num-rollout 3"
    with pytest.raises(SystemExit):
        parse_args(base.split() + extra)
    assert expected in capsys.readouterr().err
