"""Weight sync without engines: the protocol's order (pause -> move -> reset -> resume, resume also on failure)
with a fake engine group, the disk transport's writer, and the flat buckets the other transports send."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import json
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import vime.backends.vllm_utils.weight_sync as weight_sync
from vime.backends.vllm_utils.control_client import EngineControlError, EngineGroup
from vime.backends.vllm_utils.weight_transports import (
    BucketRejected,
    DistributedTransport,
    MovePhases,
    _PingPong,
    _wait_sent,
    write_hf_safetensors,
)
from vime.backends.vllm_utils.worker_extension import SYNC_TOKEN_FILE, VimeWorkerExtension
from vime.utils.async_utils import run as async_run
from vime.utils.weight_buckets import (
    add_checksums,
    bucket_layout,
    flatten_bucket,
    in_buckets,
    unflatten_bucket,
    verify_checksums,
    with_last_flag,
)


class RecordingEngines:
    """Stands in for EngineGroup: records the control calls made on the engines, in order."""

    calls: list[str] = []

    def __init__(self, urls):
        self.urls = urls

    def run(self, call):
        return [call(self)] * len(self.urls)  # one recorded call stands for all engines

    def __getattr__(self, name):
        return lambda *args, **kwargs: RecordingEngines.calls.append(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        RecordingEngines.calls.append("close")


class FakeTransport:
    stacks_experts = False

    def __init__(self, fail: bool = False):
        self.fail = fail

    def stage(self, buckets, rank, version):
        RecordingEngines.calls.append("stage")
        return buckets, 0

    def move(self, buckets, engines, rank):
        nbytes = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
        if engines is not None:
            engines.calls.append("move")
        if self.fail:
            raise RuntimeError("engine refused the bucket")
        return nbytes


@pytest.fixture
def engines(monkeypatch):
    RecordingEngines.calls = []
    monkeypatch.setattr(weight_sync, "EngineGroup", RecordingEngines)
    return RecordingEngines


def _buckets():
    return iter([[("a", torch.zeros(4))], [("b", torch.zeros(2, dtype=torch.bfloat16))]])


def test_protocol_pauses_moves_resets_and_resumes_in_order(engines):
    metrics = weight_sync.sync_weights(["http://e0", "http://e1"], _buckets(), FakeTransport(), version=7)
    assert engines.calls == ["stage", "pause", "move", "reset_prefix_cache", "resume", "close"]
    assert metrics["weight_sync/bytes"] == 20 and metrics["weight_sync/version"] == 7
    assert metrics["weight_sync/engines"] == 2
    assert metrics["weight_sync/gb_per_s"] > 0
    control = [metrics[f"weight_sync/{phase}"] for phase in ("pause_s", "reset_s", "resume_s")]
    assert min(control) >= 0 and sum(control) <= metrics["weight_sync/time_s"]


def test_engines_resume_when_the_move_fails(engines):
    with pytest.raises(RuntimeError, match="refused"):
        weight_sync.sync_weights(["http://e0"], _buckets(), FakeTransport(fail=True), version=1)
    assert engines.calls == ["stage", "pause", "move", "resume", "close"]


def test_a_failed_resume_after_a_failed_move_keeps_the_moves_error(engines, monkeypatch):
    def resume(self):
        RecordingEngines.calls.append("resume")
        raise ConnectionError("engine gone")

    monkeypatch.setattr(RecordingEngines, "resume", resume, raising=False)
    with pytest.raises(RuntimeError, match="refused") as raised:
        weight_sync.sync_weights(["http://e0"], _buckets(), FakeTransport(fail=True), version=1)
    assert any("resuming the engines afterwards failed too" in note and "engine gone" in note
               for note in raised.value.__notes__)  # fmt: skip
    assert engines.calls == ["stage", "pause", "move", "resume", "close"]


def test_other_ranks_only_take_part_in_the_move(engines):
    assert weight_sync.sync_weights(["http://e0"], _buckets(), FakeTransport(), version=1, rank=1) == {}
    assert engines.calls == ["stage"]


def test_the_paused_hook_runs_between_pause_and_move_and_the_engines_resume_when_it_fails(engines):
    def on_paused(version, urls):
        engines.calls.append(("hook", version, urls))

    weight_sync.sync_weights(["http://e0", "http://e1"], _buckets(), FakeTransport(), 3, on_paused=on_paused)
    assert engines.calls == ["stage", "pause", ("hook", 3, ["http://e0", "http://e1"]), "move",
                             "reset_prefix_cache", "resume", "close"]  # fmt: skip

    def fails(version, urls):
        raise RuntimeError("hook failed")

    engines.calls = []
    with pytest.raises(RuntimeError, match="hook failed"):
        weight_sync.sync_weights(["http://e0"], _buckets(), FakeTransport(), 4, on_paused=fails)
    assert engines.calls == ["stage", "pause", "resume", "close"]


def test_with_the_weights_check_the_engines_record_their_checksums_once_loaded(engines, monkeypatch):
    metrics = weight_sync.sync_weights(["http://e0"], _buckets(), FakeTransport(), 3, record_checksums=True)
    assert engines.calls == [
        "stage",
        "pause",
        "move",
        "collective_rpc",
        "reset_prefix_cache",
        "resume",
        "close",
    ]
    assert metrics["weight_sync/checksum_s"] >= 0

    async def fails(
        method, args
    ):  # a worker could not read its parameters: it answers, vLLM would end it on a raise
        return [{"parameters": 3}, {"error": "RuntimeError: CUDA error"}]

    monkeypatch.setattr(RecordingEngines, "collective_rpc", lambda self, *a: fails(*a), raising=False)
    monkeypatch.setattr(
        RecordingEngines, "run", lambda self, call: [run_coroutine(call(self)) for _ in self.urls]
    )
    engines.calls = []
    with pytest.raises(
        RuntimeError, match="weight sync 4: engine http://e0 worker 1 could not record .* CUDA error"
    ):
        weight_sync.sync_weights(["http://e0"], _buckets(), FakeTransport(), 4, record_checksums=True)
    assert engines.calls[-2:] == ["resume", "close"]


def run_coroutine(result):
    """A recorded call's result, awaited if it is a coroutine."""
    return async_run(result) if asyncio.iscoroutine(result) else result


def paused_hook(args, version, engine_urls):
    """A --custom-update-weight-paused-path hook: records what it saw."""
    SEEN_BY_HOOK.append((args.marker, version, engine_urls))


@pytest.mark.parametrize("rank", [0, 1])
def test_the_trainer_entry_runs_the_paused_hook_flag_on_rank_0_only(engines, monkeypatch, rank):
    from types import SimpleNamespace

    class Trainer:
        def iter_weight_buckets(self, buffer_size, stack_experts):
            return _buckets()

    monkeypatch.setattr(weight_sync, "make_transport", lambda *a: FakeTransport())
    SEEN_BY_HOOK.clear()
    args = SimpleNamespace(update_weight_buffer_size=1024, marker="mine", flush_cache_interval=None,
                           custom_update_weight_paused_path=f"{__name__}.paused_hook",
                           check_weight_update_equal=False)  # fmt: skip
    weight_sync.sync_weights_from_trainer(Trainer(), rank, args, ["http://e0"], 5, None)
    assert SEEN_BY_HOOK == ([("mine", 5, ["http://e0"])] if rank == 0 else [])


def test_buckets_and_the_last_flag():
    named = [(str(i), torch.zeros(i + 1)) for i in range(4)]  # 4, 8, 12, 16 bytes
    buckets = list(in_buckets(named, 12))
    assert [[n for n, _ in b] for b in buckets] == [["0", "1"], ["2"], ["3"]]
    assert [last for _, last in with_last_flag(iter(buckets))] == [False, False, True]
    assert list(with_last_flag(iter([]))) == []


def test_flatten_reuses_a_large_enough_buffer_and_round_trips():
    g = torch.Generator().manual_seed(0)
    bucket = [("w", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g).to(torch.bfloat16))]
    layout, nbytes = bucket_layout(bucket)
    big = torch.empty(nbytes + 100, dtype=torch.uint8)
    buffer, again = flatten_bucket(bucket, torch.device("cpu"), big)
    assert again == layout and buffer.numel() == nbytes and buffer.data_ptr() == big.data_ptr()
    assert all(
        torch.equal(x, y) for (_, x), (_, y) in zip(unflatten_bucket(buffer, layout), bucket, strict=True)
    )
    small, _ = flatten_bucket(bucket, torch.device("cpu"), torch.empty(8, dtype=torch.uint8))
    assert small.numel() == nbytes  # too small: a new buffer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_each_tensor_changed_on_the_way_is_named_by_its_checksum(dtype):
    g = torch.Generator().manual_seed(0)
    odd = torch.randint(0, 255, (7,), generator=g, dtype=torch.uint8) if dtype == torch.uint8 else None
    bucket = [
        (
            "model.norm.weight",
            torch.randn(3, generator=g).to(dtype) if odd is None else odd,
        ),  # odd byte counts
        ("model.layers.0.mlp.up_proj.weight", torch.randn(4, 5, generator=g).to(torch.float32)),
    ]
    buffer, layout = flatten_bucket(bucket, torch.device("cpu"))
    add_checksums(buffer, layout)
    received = buffer.clone()
    verify_checksums(received, json.loads(json.dumps(layout)))  # the layout travels as JSON
    for entry in layout:
        changed = received.clone()
        changed[entry["offset"]] ^= 1  # one bit of the tensor's first byte
        with pytest.raises(ValueError, match=rf"{re.escape(entry['name'])} .* arrived changed"):
            verify_checksums(changed, layout)
    padding = received.clone()
    first = bucket[0][1]
    padding[first.numel() * first.element_size() : layout[1]["offset"]] = 255  # alignment bytes: not checked
    verify_checksums(padding, layout)


def test_ping_pong_buffers_alternate_and_grow():
    staging = _PingPong(torch.device("cpu"))
    one, two = [("x", torch.ones(16))], [("x", torch.ones(64))]
    first, _, new0 = staging.fill(0, one)
    second, _, new1 = staging.fill(1, one)
    again, _, new2 = staging.fill(2, one)
    grown, _, new3 = staging.fill(3, two)
    assert new0 and new1 and not new2 and new3
    assert again.data_ptr() == first.data_ptr() != second.data_ptr()
    assert grown.numel() == 256


def test_written_files_load_back_equal_and_replace_old_ones(tmp_path):
    g = torch.Generator().manual_seed(0)
    weights = {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=g),
        "model.norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=g).t(),  # non-contiguous
    }
    (tmp_path / "stale.safetensors").write_bytes(b"old")
    buckets = [[(name, weights[name])] for name in weights]
    nbytes = write_hf_safetensors(iter(buckets), tmp_path)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert [f.name for f in files] == [f"model-{i:05d}.safetensors" for i in range(3)]
    loaded = {name: t for f in files for name, t in load_file(f).items()}
    assert loaded.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype
    assert nbytes == sum(t.numel() * t.element_size() for t in weights.values())


def test_make_transport_builds_each_once_and_names_a_missing_directory(tmp_path):
    from types import SimpleNamespace

    from vime.backends.vllm_utils.weight_transports import (
        DiskTransport,
        DistributedTransport,
        TensorTransport,
    )

    def args(transport, weight_dir=None):
        return SimpleNamespace(update_weight_transport=transport, rollout_num_gpus_per_engine=2,
                               update_weight_dir=weight_dir, update_weight_disk_keep_files=False,
                               custom_update_weight_post_write_path=None)  # fmt: skip

    urls = ["http://e0", "http://e1"]
    disk = weight_sync.make_transport(args("disk"), urls, tmp_path, rank=0)
    assert (
        isinstance(disk, DiskTransport)
        and weight_sync.make_transport(args("disk"), urls, tmp_path, 0) is disk
    )
    nccl = weight_sync.make_transport(args("distributed"), urls, None, rank=0)
    assert isinstance(nccl, DistributedTransport) and nccl.world_size == 1 + 2 * 2
    ipc = weight_sync.make_transport(args("tensor"), urls, None, rank=0)
    assert isinstance(ipc, TensorTransport) and ipc.num_workers == 4
    with pytest.raises(ValueError, match="needs a shared directory: pass --update-weight-dir"):
        weight_sync.make_transport(args("disk"), ["http://other"], None, rank=0)


SEEN_BY_HOOK: list[tuple] = []


def post_write_hook(args, version_dir, rollout_engines):
    """A --custom-update-weight-post-write-path hook: records what it saw when it ran."""
    SEEN_BY_HOOK.append(
        (args.marker, version_dir, sorted(p.name for p in Path(version_dir).iterdir()), rollout_engines)
    )


@pytest.mark.parametrize("keep", [False, True])
def test_disk_sync_writes_a_directory_per_version_runs_the_hook_and_cleans_up(tmp_path, keep, monkeypatch):
    from types import SimpleNamespace

    reloaded = []

    class DiskEngines(RecordingEngines):
        """Engines on the trainer's node: they read the sync token and record what each reload found."""

        def run(self, call):
            return [call(self)]

        def collective_rpc(self, method, kwargs):
            # vime's worker extension: reload, then CPU MoE prepacking
            if method == "reload_weights_from_path":
                path = kwargs["weights_path"]
                return [reloaded.append((path, sorted(os.listdir(path))))]
            return [Path(kwargs["path"]).read_text()]

    monkeypatch.setattr(weight_sync, "EngineGroup", DiskEngines)

    SEEN_BY_HOOK.clear()
    args = SimpleNamespace(update_weight_transport="disk", rollout_num_gpus_per_engine=1, update_weight_dir=None,
                           update_weight_disk_keep_files=keep, marker="mine",
                           custom_update_weight_post_write_path=f"{__name__}.post_write_hook")  # fmt: skip
    transport = weight_sync.make_transport(args, ["http://e0"], tmp_path / f"w{keep}", rank=0)
    for version in (1, 2):
        weight_sync.sync_weights(["http://e0"], _buckets(), transport, version)
    dirs = [str(tmp_path / f"w{keep}" / f"v{v:07d}") for v in (1, 2)]
    files = ["model-00000.safetensors", "model-00001.safetensors"]
    assert SEEN_BY_HOOK == [("mine", d, files, ["http://e0"]) for d in dirs]  # written before the hook ran
    assert reloaded == [(d, [*files, SYNC_TOKEN_FILE]) for d in dirs]  # each version's own directory
    assert [Path(d).is_dir() for d in dirs] == [keep, keep]  # deleted once loaded unless kept


class TokenReadingEngines:
    """Engines that read the disk transport's token file from their own node: ``views[i]`` maps the trainer's path
    to what engine ``i`` finds there (None: the directory is not on its node)."""

    def __init__(self, views):
        self.urls = [f"http://e{i}" for i in range(len(views))]
        self.views, self.reloaded = views, []

    def run(self, call):
        return [call(_TokenClient(self, i)) for i in range(len(self.urls))]


class _TokenClient:
    def __init__(self, group, i):
        self.group, self.i = group, i

    def collective_rpc(self, method, kwargs):
        if method == "reload_weights_from_path":
            return [self.group.reloaded.append((self.i, kwargs["weights_path"]))]
        assert method == "read_sync_token"
        view = self.group.views[self.i]
        return [view(kwargs["path"]) if view else None]


def test_disk_engines_reload_only_once_each_reads_the_trainers_token(tmp_path):
    from pathlib import Path

    from vime.backends.vllm_utils.weight_transports import DiskTransport

    disk = DiskTransport(tmp_path / "w", keep_files=True)
    disk.stage(_buckets(), 0, 1)
    shared = TokenReadingEngines([lambda path: Path(path).read_text()] * 2)
    assert disk.move(iter(()), shared, rank=0) == 0
    assert shared.reloaded == [(0, str(tmp_path / "w" / "v0000001")), (1, str(tmp_path / "w" / "v0000001"))]

    disk.stage(
        _buckets(), 0, 2
    )  # a new token per sync: an engine reading last sync's directory is caught too
    stale = TokenReadingEngines([lambda path: Path(path).read_text(), lambda path: "an old token"])
    with pytest.raises(
        RuntimeError, match=r"engine at http://e1 does not see the weights .* shared by the trainer"
    ):
        disk.move(iter(()), stale, rank=0)
    elsewhere = TokenReadingEngines([lambda path: Path(path).read_text(), None])
    with pytest.raises(
        RuntimeError, match=r"http://e1 .*reads \[None\].*--update-weight-transport distributed"
    ):
        disk.move(iter(()), elsewhere, rank=0)
    assert stale.reloaded == elsewhere.reloaded == []


def test_an_engine_control_error_crosses_processes_as_itself():
    """A sync that fails on an engine reaches the driver (through Ray) as EngineControlError, which
    --use-fault-tolerance recognises; an exception it cannot unpickle would end the run."""
    import pickle

    from vime.backends.vllm_utils.control_client import EngineControlError

    error = pickle.loads(pickle.dumps(EngineControlError("resume", "http://e1/resume", None, "refused")))
    assert (
        isinstance(error, EngineControlError) and error.url == "http://e1/resume" and "refused" in str(error)
    )


def test_move_phases_time_iteration_and_add_the_slowest_worker_per_bucket():
    phases = MovePhases()
    assert list(phases.timed("gather_s", iter([1, 2]))) == [1, 2] and phases["gather_s"] > 0
    with phases.span("pack_s"):
        pass
    assert phases["pack_s"] > 0
    for answers in (
        [
            [{"receive_s": 1.0, "load_s": 2.0}, {"receive_s": 3.0, "load_s": 0.5}],
            [{"receive_s": 0.1, "load_s": 4.0}],
        ],
        [[{"load_s": 1.0}], None],  # an engine that answers nothing (vLLM's None) counts for nothing
    ):
        done = concurrent.futures.Future()
        done.set_result(answers)
        assert phases.wait("engine_wait_s", done, ["http://e0", "http://e1"]) == answers
    assert phases["engine_receive_s"] == 3.0 and phases["engine_load_s"] == 5.0
    failed = concurrent.futures.Future()
    failed.set_exception(RuntimeError("engine refused"))
    with pytest.raises(RuntimeError, match="engine refused"):
        phases.wait("engine_wait_s", failed, ["http://e0"])
    rejected = concurrent.futures.Future()
    rejected.set_result([[{"load_s": 1.0}], [{"load_s": 1.0}, {"rejected": "w arrived changed"}]])
    with pytest.raises(
        BucketRejected, match=r"engine http://e1 \(worker 1\) rejected a bucket: w arrived changed"
    ):
        phases.wait("engine_wait_s", rejected, ["http://e0", "http://e1"])
    left = concurrent.futures.Future()
    left.set_result([[{"aborted": "the trainer gave the sync up"}]])
    with pytest.raises(RuntimeError, match=r"engine http://e0 \(worker 0\) left the sync: the trainer gave"):
        phases.wait("engine_wait_s", left, ["http://e0"])


class FakeWork:
    def __init__(self, done: bool = True, error: Exception | None = None):
        self.done, self.error = done, error

    def is_completed(self):
        return self.done

    def wait(self):
        if self.error:
            raise self.error


def test_a_broadcast_waiting_on_a_failed_engine_raises_the_engines_error():
    answers = concurrent.futures.Future()
    answers.set_exception(ConnectionError("engine http://e0 gone"))
    with pytest.raises(ConnectionError, match="e0 gone"):  # not stuck until the group's timeout
        _wait_sent([FakeWork(done=False)], answers)
    with pytest.raises(ConnectionError, match="e0 gone") as raised:  # the broadcast failed first
        _wait_sent([FakeWork(error=RuntimeError("connection reset"))], answers)
    assert "connection reset" in str(raised.value.__cause__)
    pending = concurrent.futures.Future()
    _wait_sent([FakeWork(), FakeWork()], pending)  # sent: the answers are not awaited


class CpuWorker(VimeWorkerExtension):
    """A vLLM CPU worker as far as the worker extension needs one: worker 0 of its engine, a model without fused MoE,
    and ``reload_weights`` recording what each reload loaded."""

    rank = 0

    def __init__(self):
        self.model_runner = SimpleNamespace(get_model=torch.nn.Module)
        self.loaded: list[dict[str, torch.Tensor]] = []

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        self.loaded.append(dict(weights_iterator))


class WorkerClient:
    """An engine's control client whose ``collective_rpc`` runs the method on its in-process worker, on one thread of
    its own (as the engine core would), keeping the answers."""

    def __init__(self, worker: CpuWorker, url: str):
        self.worker, self.url = worker, url
        self.engine_thread = concurrent.futures.ThreadPoolExecutor(1)
        self.answers: list = []

    async def collective_rpc(self, method, args=None, kwargs=None):
        call = functools.partial(getattr(self.worker, method), *(args or []), **(kwargs or {}))
        answer = await asyncio.get_running_loop().run_in_executor(self.engine_thread, call)
        self.answers.append(answer)
        return [answer]

    async def close(self):
        pass


class DyingClient(WorkerClient):
    """An engine killed once it joined the weight group: at the sync its member of the group goes (its connections
    close, as when its process dies) and the call fails as a call to a dead engine does."""

    async def collective_rpc(self, method, args=None, kwargs=None):
        if method == "init_weight_update_group":
            return await super().collective_rpc(method, args, kwargs)
        self.worker._vime_weight_group = None
        raise EngineControlError(f"collective_rpc {method}", self.url, None, "ClientConnectorError(refused)")


def engine_group(clients: list[WorkerClient]) -> EngineGroup:
    engines = EngineGroup([client.url for client in clients])
    engines.clients = clients
    return engines


def test_when_an_engine_dies_mid_sync_the_survivor_leaves_its_call_and_takes_the_next_sync_whole():
    """The streamed receive (one call per sync) over a real gloo weight group: an engine dies in the sync, the
    trainer gives the sync up, and the surviving engine leaves its call at once (not at the group's timeout: gloo's
    pending receive would wait that long, NCCL's forever), drops what it staged of the sync, and the sync done again
    without the dead engine loads every bucket."""
    survivor = WorkerClient(CpuWorker(), "http://127.0.0.1:1")
    engines = engine_group([survivor, DyingClient(CpuWorker(), "http://127.0.0.2:1")])
    transport = DistributedTransport(engines.urls, workers_per_engine=1, rank=0, backend="gloo", timeout_s=60)
    transport.connect(engines)
    survivor.answers.clear()
    # the trainer's member of the group outlives the sync (as when its traceback holds it): its connections stay
    # open, so the survivor's pending receive does not fail, and a worker that dropped its member with it pending
    # would wait in the destructor until the group's timeout
    trainer_member = transport.group
    buckets = [[(f"w{i}", torch.full((256, 1024), float(i)))] for i in range(6)]  # 1 MiB each
    started = time.monotonic()
    with pytest.raises(EngineControlError, match="127.0.0.2"):
        transport.move(iter(buckets), engines, rank=0)
    while not survivor.answers and time.monotonic() - started < 30:
        time.sleep(0.01)
    assert time.monotonic() - started < 10, "the survivor stayed in its call"
    assert "the trainer gave the sync up" in survivor.answers[0]["aborted"]
    assert survivor.worker._vime_weight_group is None and transport.group is None
    assert "_vime_staged_weights" not in survivor.worker.__dict__ and survivor.worker.loaded == []

    alone = engine_group([survivor])
    again = DistributedTransport(alone.urls, workers_per_engine=1, rank=0, backend="gloo", timeout_s=60)
    try:
        assert again.move(iter(buckets), alone, rank=0) == 6 * (1 << 20)
    finally:
        again.close()
    assert survivor.answers[-1]["load_s"] > 0 and again.phases["engine_receive_s"] > 0
    loaded = survivor.worker.loaded[-1]
    assert sorted(loaded) == [f"w{i}" for i in range(6)]
    assert all(torch.equal(loaded[name], tensor) for bucket in buckets for name, tensor in bucket)
    gc.collect()  # the survivor's old member of the group is not destroyed while its receive is pending: that waits
    assert time.monotonic() - started < 20, (
        "a thread waited on the old group"
    )  # (in any thread) for the timeout
    del trainer_member
