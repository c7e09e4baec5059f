"""``bench/trainer_throughput.py --profile``'s account of where the GPU waits for the host, on profiler events made
by hand: the gaps between kernels (streams merged) charged to the call site of the op whose kernel ends each."""

from __future__ import annotations

from types import SimpleNamespace

from torch.autograd import DeviceType

from bench.trainer_throughput import gpu_idle_gaps

CPU, CUDA = DeviceType.CPU, DeviceType.CUDA


def _op(id_: int, name: str, stack: list[str], parent=None) -> SimpleNamespace:
    return SimpleNamespace(
        id=id_, name=name, device_type=CPU, cpu_parent=parent, stack=stack, linked_correlation_id=0
    )


def _kernel(start: float, end: float, op: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(
        name="k",
        device_type=CUDA,
        time_range=SimpleNamespace(start=start, end=end),
        linked_correlation_id=op.id,
    )


def test_gaps_are_charged_to_the_op_whose_kernel_ends_them():
    forward = _op(1, "forward", ["model.py(10): forward"])
    index = _op(2, "aten::index_select", [], parent=forward)  # no stack of its own: its parent's is used
    loss = _op(3, "aten::mul", ["loss.py(5): loss"])
    launch = SimpleNamespace(id=2, name="cudaLaunchKernel", device_type=CPU, cpu_parent=None, stack=[],
                             linked_correlation_id=7)  # fmt: skip  # a runtime event reusing an op's id
    events = [
        forward, index, loss, launch,
        _kernel(0, 300, forward),
        _kernel(50, 100, forward),  # inside the first (another stream): the GPU stays busy until 300
        _kernel(302, 310, forward),  # a 2 us gap: under the threshold
        _kernel(1310, 1400, index),  # 1000 us idle, ended by index_select's kernel
        _kernel(1700, 1800, loss),  # 300 us
        _kernel(2000, 2100, index),  # 200 us
    ]  # fmt: skip
    report = gpu_idle_gaps(events, min_gap_us=5)
    lines = report.splitlines()
    assert lines[0].startswith("GPU idle: 0.002 s in 3 gaps of >= 5 us")
    assert lines[1].split() == ["2", "0.001", "s", "aten::index_select"]  # 1,200 us: the largest first
    assert lines[2].strip() == "model.py(10): forward"
    assert lines[3].split() == ["1", "0.000", "s", "aten::mul"] and lines[4].strip() == "loss.py(5): loss"


def test_a_kernel_whose_op_was_not_recorded_is_named():
    op = _op(1, "aten::mm", ["a.py(1): f"])
    stray = SimpleNamespace(name="gemm", device_type=CUDA, time_range=SimpleNamespace(start=500, end=600),
                            linked_correlation_id=99)  # fmt: skip
    report = gpu_idle_gaps([op, _kernel(0, 100, op), stray])
    assert "(kernel gemm: launching op not recorded)" in report and "in 1 gaps" in report
