"""`python -m benchmarks.call_timeline`: where one waited-for forward's time goes, host and device.

`bench`'s latency (one call, waited for) exceeds the device's span of the same forward by three
things `kernel_gaps` (back-to-back calls, device events only) cannot separate: the host's work
before the first kernel starts (JAX's dispatch, XLA's buffer setup and command-buffer launches),
device idle time inside the call while the stream waits for the host (a torch callback's Python
and its library's launch path), and the runtime's wake-up after the last kernel ends. This
traces `--calls` single waited calls of the FP8 layer (`bench`'s shapes, `fused_moe(experts=...)`
as in `kernel_gaps`), each inside a `jax.profiler.TraceAnnotation` after a short pause, and
reads from the profile's host and device planes, per call (offsets from the call's start):

- the first kernel's start and the last kernel's end, the device's busy and idle time between;
- the wake-up: the call's end minus the last kernel's end;
- each torch callback's host time (`buffer_callback` events) and the host time of XLA's
  CUDA-graph launches (`cuGraphLaunch` events).

    python -m benchmarks.call_timeline --shape B --experts deep_gemm --calls 8 [--json t.json]

The profiler lengthens the host's side (CUPTI records every launch; the Python tracer is off,
as in `kernel_gaps`), so compare these figures across experts or code versions, not with
`bench`'s latency. Needs a GPU (the CPU backend's trace has no device kernels; the command says
so and exits 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import jax

from benchmarks import kernel_gaps

CALL_PREFIX = "moe_jax_waited_call_"  # the TraceAnnotation around each timed call
WARMUP = 3  # untraced calls first: compilation, autotuning, DeepGEMM's JIT
CALLBACK_PREFIX = "buffer_callback"  # XLA's host event of a torch callback (`interop.bridge`)
GRAPH_LAUNCH_PREFIX = "cuGraphLaunch"  # XLA's command buffer launched as a CUDA graph


@dataclasses.dataclass(frozen=True)
class TraceEvent(kernel_gaps.KernelEvent):
    """One event of a profile: `kernel_gaps.KernelEvent`'s name, start and duration in
    nanoseconds, and its plane ("/host:CPU", "/device:GPU:0") and line (a host thread, a device
    stream)."""

    plane: str
    line: str

    @property
    def is_kernel(self) -> bool:
        """A kernel on a device stream (`kernel_gaps.is_kernel`, as `kernel_gaps` counts them)."""
        return kernel_gaps.is_kernel(self.plane, self.line, self.name)


@dataclasses.dataclass(frozen=True)
class CallTimeline:
    """One waited call, in microseconds from its start (see the module docstring)."""

    call_us: float
    kernels: int
    first_kernel_us: float
    last_kernel_end_us: float
    device_busy_us: float
    device_idle_us: float
    wake_us: float
    callbacks_us: tuple[float, ...]
    graph_launches_us: float


def read_events(xplane_path: str) -> list[TraceEvent]:
    """Every event of every plane and line of a `jax.profiler` trace (.xplane.pb)."""
    data = jax.profiler.ProfileData.from_file(xplane_path)
    return [
        TraceEvent(
            event.name,
            float(event.start_ns),
            float(event.duration_ns),
            plane=plane.name,
            line=line.name,
        )
        for plane in data.planes
        for line in plane.lines
        for event in line.events
    ]


def call_timeline(call: TraceEvent, events: Sequence[TraceEvent]) -> CallTimeline:
    """The timeline of the call whose annotation is `call`, from the events that start inside it.

    Raises ValueError when no kernel starts inside the call (a CPU trace, or a call whose work
    ran before the profiler started).

    Example (a 100 ns call: a kernel from 20 to 50, one from 60 to 70, a callback of 30):
      >>> host = dict(plane="/host:CPU", line="python")
      >>> gpu = dict(plane="/device:GPU:0", line="Stream #1")
      >>> call = TraceEvent("c", 0, 100, **host)
      >>> events = [TraceEvent("k", 20, 30, **gpu), TraceEvent("k", 60, 10, **gpu),
      ...           TraceEvent("buffer_callback.2", 25, 30, **host)]
      >>> t = call_timeline(call, events)
      >>> t.first_kernel_us * 1e3, t.device_idle_us * 1e3, t.wake_us * 1e3, t.callbacks_us
      (20.0, 10.0, 30.0, (0.03,))
    """
    inside = [e for e in events if e is not call and call.start_ns <= e.start_ns <= call.end_ns]
    kernels = [e for e in inside if e.is_kernel]
    if not kernels:
        raise ValueError(f"no device kernel starts inside {call.name!r}: is the backend a GPU?")
    gaps = kernel_gaps.summarize(kernels)
    first = min(k.start_ns for k in kernels)
    last = max(k.end_ns for k in kernels)
    host = [e for e in inside if e.plane.startswith("/host")]
    return CallTimeline(
        call_us=call.duration_ns / 1e3,
        kernels=len(kernels),
        first_kernel_us=(first - call.start_ns) / 1e3,
        last_kernel_end_us=(last - call.start_ns) / 1e3,
        device_busy_us=gaps.busy_ns / 1e3,
        device_idle_us=gaps.idle_ns / 1e3,
        wake_us=(call.end_ns - last) / 1e3,
        callbacks_us=tuple(
            e.duration_ns / 1e3
            for e in sorted(host, key=lambda e: e.start_ns)
            if e.name.startswith(CALLBACK_PREFIX)
        ),
        graph_launches_us=sum(e.duration_ns for e in host if e.name.startswith(GRAPH_LAUNCH_PREFIX))
        / 1e3,
    )


def trace_waited_calls(
    fn: Callable, args: tuple, calls: int, pause_s: float, trace_dir: str
) -> tuple[str, list[float]]:
    """Runs `fn(*args)` WARMUP times, then `calls` times each waited for, in a trace: each call
    inside a TraceAnnotation named CALL_PREFIX + its index, after a pause of `pause_s` (the
    device idle, as for a call that is waited for). Returns (the .xplane.pb path, each call's
    host clock in us)."""
    for _ in range(WARMUP):
        jax.block_until_ready(fn(*args))
    walls = []
    with jax.profiler.trace(trace_dir, profiler_options=kernel_gaps.profiler_options()):
        for i in range(calls):
            time.sleep(pause_s)
            with jax.profiler.TraceAnnotation(f"{CALL_PREFIX}{i}"):
                start = time.perf_counter()
                jax.block_until_ready(fn(*args))
                walls.append((time.perf_counter() - start) * 1e6)
    return kernel_gaps.latest_xplane(trace_dir), walls


def _row(label: str, t: CallTimeline) -> str:
    callbacks = "+".join(f"{us:.0f}" for us in t.callbacks_us) or "-"
    return (
        f"{label:>8} {t.call_us:8.1f} {t.first_kernel_us:8.1f} {t.device_busy_us:8.1f} "
        f"{t.device_idle_us:8.1f} {t.wake_us:8.1f} {t.graph_launches_us:8.1f}  {callbacks}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.call_timeline", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--shape", default="B", help="a `bench` shape: A, B or small")
    parser.add_argument(
        "--experts", default="auto", help="`fused_moe(experts=...)`, as kernel_gaps"
    )
    parser.add_argument("--calls", type=int, default=8, help="waited calls traced")
    parser.add_argument("--pause-ms", type=float, default=5.0, help="host pause before each call")
    parser.add_argument("--json", help="also write every call's timeline to this JSON file")
    args = parser.parse_args(argv)
    error = kernel_gaps.layer_args_error(args.shape, args.experts)
    if error:
        print(error, file=sys.stderr)
        return 2
    if args.calls < 1 or args.pause_ms < 0:
        print(
            f"--calls {args.calls} --pause-ms {args.pause_ms}: need >= 1 and >= 0", file=sys.stderr
        )
        return 2
    if jax.default_backend() != "gpu":
        print("needs a GPU: the CPU backend's trace has no device kernels", file=sys.stderr)
        return 2
    fn, fn_args = kernel_gaps.forward_fn(args.shape, args.experts)
    with tempfile.TemporaryDirectory() as trace_dir:
        path, walls = trace_waited_calls(fn, fn_args, args.calls, args.pause_ms / 1e3, trace_dir)
        events = read_events(path)
    annotations = sorted(
        (e for e in events if e.name.startswith(CALL_PREFIX)), key=lambda e: e.start_ns
    )
    timelines = [call_timeline(call, events) for call in annotations]
    print(
        f"shape {args.shape}, experts={args.experts}: {len(timelines)} waited calls traced "
        f"(host clock per call, us: {', '.join(f'{w:.0f}' for w in walls)})"
    )
    print(
        "    call   us from the call's start: call   first kernel  busy  idle  wake  "
        "graph launches  callbacks (host us)"
    )
    for i, t in enumerate(timelines):
        print(_row(str(i), t))
    median = {
        field.name: statistics.median(getattr(t, field.name) for t in timelines)
        for field in dataclasses.fields(CallTimeline)
        if field.name != "callbacks_us"
    }
    print(_row("median", CallTimeline(**median, callbacks_us=())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    shape=args.shape,
                    experts=args.experts,
                    host_clock_us=walls,
                    calls=[dataclasses.asdict(t) for t in timelines],
                ),
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
