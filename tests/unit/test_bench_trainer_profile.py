"""``bench/trainer_throughput.py --profile``'s account of where the GPU waits for the host, on profiler events made
by hand as torch 2.11 makes them: the gaps between kernels (streams merged) charged to the call site of the op that
launched the kernel ending each (kernel -> runtime launch by correlation id -> the op around the launch)."""

from __future__ import annotations

from types import SimpleNamespace

from torch.autograd import DeviceType

from bench.trainer_throughput import gpu_idle_gaps

CPU, CUDA = DeviceType.CPU, DeviceType.CUDA


def _op(id_: int, name: str, stack: list[str], parent=None) -> SimpleNamespace:
    return SimpleNamespace(id=id_, name=name, device_type=CPU, cpu_parent=parent, stack=stack)


def _launch(correlation_id: int, op: SimpleNamespace, name: str = "cudaLaunchKernel") -> SimpleNamespace:
    return _op(correlation_id, name, [], parent=op)


def _kernel(start: float, end: float, launch: SimpleNamespace, name: str = "k") -> SimpleNamespace:
    return SimpleNamespace(
        id=launch.id, name=name, device_type=CUDA, time_range=SimpleNamespace(start=start, end=end)
    )


def test_gaps_are_charged_to_the_op_whose_kernel_ends_them():
    forward = _op(1, "forward", ["model.py(10): forward"])
    index = _op(2, "aten::index_select", [], parent=forward)  # no stack of its own: its parent's is used
    loss = _op(3, "aten::mul", ["loss.py(5): loss"])
    # runtime calls' correlation ids are their own counter: 2 and 3 are also the ids of the ops above
    launch_forward, launch_index = _launch(100, forward), _launch(2, index)
    launch_loss, launch_index_2 = _launch(3, loss, name="cudaMemcpyAsync"), _launch(104, index)
    events = [
        launch_forward, launch_index, launch_loss, launch_index_2, forward, index, loss,  # launches first: no op shadows them
        _kernel(0, 300, launch_forward),
        _kernel(50, 100, launch_forward),  # inside the first (another stream): the GPU stays busy until 300
        _kernel(302, 310, launch_forward),  # a 2 us gap: under the threshold
        _kernel(1310, 1400, launch_index),  # 1000 us idle, ended by index_select's kernel
        _kernel(1700, 1800, launch_loss),  # 300 us
        _kernel(2000, 2100, launch_index_2),  # 200 us
    ]  # fmt: skip
    report = gpu_idle_gaps(events, min_gap_us=5)
    lines = report.splitlines()
    assert lines[0].startswith("GPU idle: 0.002 s in 3 gaps of >= 5 us")
    assert lines[1].split() == ["2", "0.001", "s", "aten::index_select"]  # 1,200 us: the largest first
    assert lines[2].strip() == "model.py(10): forward"
    assert lines[3].split() == ["1", "0.000", "s", "aten::mul"] and lines[4].strip() == "loss.py(5): loss"


def test_a_kernel_whose_launch_was_not_recorded_is_named():
    op = _op(1, "aten::mm", ["a.py(1): f"])
    launch = _launch(7, op)
    # the profiler's own events carry correlation id 0, as may a kernel it could not link (torch 2.11 profiled a
    # step's 8,770 gaps all onto one "Activity Buffer Request" when id 0 was looked up)
    profiler_event = _op(0, "Activity Buffer Request", ["torch/profiler.py(1): step"])
    profiler_call = _launch(0, profiler_event, name="cuptiActivityFlushAll")
    unlinked = SimpleNamespace(
        id=0, name="gemm", device_type=CUDA, time_range=SimpleNamespace(start=500, end=600)
    )
    stray = SimpleNamespace(
        id=99, name="gemv", device_type=CUDA, time_range=SimpleNamespace(start=700, end=800)
    )
    report = gpu_idle_gaps(
        [op, launch, profiler_event, profiler_call, _kernel(0, 100, launch), unlinked, stray]
    )
    assert (
        "(kernel gemm: its launch not recorded)" in report
        and "(kernel gemv: its launch not recorded)" in report
    )
    assert "in 2 gaps" in report and "Activity Buffer Request" not in report
