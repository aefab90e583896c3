"""`python -m benchmarks.call_timeline`: one waited call's host and device timeline, read from
synthetic profile events (the GPU run itself needs a GPU) and from a real CPU trace."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import script_modules

ct = script_modules.benchmark("call_timeline")

GPU, HOST = "/device:GPU:0", "/host:CPU"


def _event(plane, name, start, duration, line=None):
    line = line or ("Stream #14(Compute)" if plane == GPU else "python3")
    return ct.TraceEvent(name, float(start), float(duration), plane=plane, line=line)


def test_timeline_of_one_call_from_host_and_device_events():
    call = _event(HOST, f"{ct.CALL_PREFIX}3", 1_000, 10_000)
    events = [
        call,
        _event(HOST, "cuGraphLaunch (CudaGraph:8)", 1_200, 700),
        _event(GPU, "routing_fusion", 2_000, 500),
        _event(GPU, "permute", 2_400, 600),  # overlaps the last one: busy counts it once
        _event(HOST, "buffer_callback.2", 2_500, 2_400),
        _event(GPU, "memcpyDtoD", 3_000, 900),  # a copy, not a kernel
        _event(GPU, "deep_gemm_gemm1", 4_000, 3_000),  # waited 1000 ns for the callback
        _event(HOST, "buffer_callback.3", 5_000, 900),
        _event(GPU, "unpermute", 7_000, 1_000, line="Stream #20(Compute)"),
        _event(GPU, "next_call_kernel", 11_500, 100),  # after the call: not counted
        _event(HOST, "cuGraphLaunch (CudaGraph:9)", 500, 100),  # before the call: not counted
    ]
    t = ct.call_timeline(call, events)
    assert t.kernels == 4
    assert t.first_kernel_us == pytest.approx(1.0)
    assert t.last_kernel_end_us == pytest.approx(7.0)
    assert t.device_busy_us == pytest.approx(1.0 + 3.0 + 1.0)  # 2000-3000, 4000-8000
    assert t.device_idle_us == pytest.approx(1.0)
    assert t.wake_us == pytest.approx(3.0)  # the call ends at 11000, the last kernel at 8000
    assert t.callbacks_us == pytest.approx((2.4, 0.9))  # in the order they ran
    assert t.graph_launches_us == pytest.approx(0.7)
    assert t.call_us == pytest.approx(10.0)


def test_timeline_refuses_a_call_without_kernels():
    call = _event(HOST, f"{ct.CALL_PREFIX}0", 0, 1_000)
    with pytest.raises(ValueError, match="no device kernel starts inside"):
        ct.call_timeline(call, [call, _event(HOST, "buffer_callback.1", 10, 20)])


def test_reads_a_real_trace_with_the_call_annotations(tmp_path):
    """The tracing loop and the reader on this backend: one annotation per waited call, and on
    the CPU no device kernel, which call_timeline says."""
    fn = jax.jit(lambda x: jnp.sin(x) * 2)
    path, walls = ct.trace_waited_calls(fn, (jnp.ones(64),), 3, 0.0, str(tmp_path))
    assert len(walls) == 3 and all(w > 0 for w in walls)
    events = ct.read_events(path)
    calls = sorted(
        (e for e in events if e.name.startswith(ct.CALL_PREFIX)), key=lambda e: e.start_ns
    )
    assert [e.name for e in calls] == [f"{ct.CALL_PREFIX}{i}" for i in range(3)]
    assert all(e.plane.startswith("/host") for e in calls)
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="is the backend a GPU"):
            ct.call_timeline(calls[0], events)
    else:
        assert ct.call_timeline(calls[-1], events).kernels >= 1


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the refusal off a GPU")
def test_command_line_refuses_without_a_gpu_and_checks_its_arguments(capsys):
    assert ct.main(["--shape", "small"]) == 2
    assert "needs a GPU" in capsys.readouterr().err
    assert ct.main(["--shape", "Z"]) == 2
    assert "unknown shape 'Z'" in capsys.readouterr().err
    assert ct.main(["--experts", "nonsense"]) == 2
    assert "unknown --experts 'nonsense'" in capsys.readouterr().err
    assert ct.main(["--calls", "0"]) == 2
    assert "--calls 0" in capsys.readouterr().err
