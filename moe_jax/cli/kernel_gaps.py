"""`python -m moe_jax.cli.kernel_gaps`: where the GPU idles between the kernels of a forward.

Traces back-to-back FP8 layer forwards (`fused_moe(experts="auto")` on `bench`'s shapes) with
`jax.profiler`, reads the GPU kernel events of the trace (`jax.profiler.ProfileData`), and
reports per forward: the span from first kernel start to last kernel end, the time some kernel
ran (busy), the idle rest (gaps), and the largest gaps with the kernels on either side:

    python -m moe_jax.cli.kernel_gaps --shape A --forwards 10 [--json gaps.json]

A gap is device idle time: the stream waits for the host (a slow launch, a torch callback's
Python, a synchronisation) or for an allocation. This is the profile issue 14 asks for; `bench
--breakdown` gives the stages' times, this gives what lies between them. Needs a GPU (the CPU
backend's trace has no device kernels; the command says so and exits 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence

import jax

TOP_GAPS = 5  # largest gaps listed per report


@dataclasses.dataclass(frozen=True)
class KernelEvent:
    """One kernel on the device timeline: name, start and duration in nanoseconds."""

    name: str
    start_ns: float
    duration_ns: float

    @property
    def end_ns(self) -> float:
        return self.start_ns + self.duration_ns


@dataclasses.dataclass(frozen=True)
class Gap:
    """Device idle time between the end of `before` and the start of `after`."""

    ns: float
    before: str
    after: str


@dataclasses.dataclass(frozen=True)
class GapSummary:
    """One stretch of the timeline: span = busy + idle (ns), and its largest gaps."""

    num_kernels: int
    span_ns: float
    busy_ns: float
    idle_ns: float
    largest: tuple[Gap, ...]


def summarize(events: Iterable[KernelEvent], *, top: int = TOP_GAPS) -> GapSummary:
    """Busy time (union of kernel intervals, so overlapping streams count once), idle time and
    the `top` largest gaps of a set of kernel events.

    Example (b and c overlap, on two streams):
      >>> events = [KernelEvent("a", 0, 10), KernelEvent("b", 15, 5), KernelEvent("c", 17, 10)]
      >>> s = summarize(events)
      >>> s.span_ns, s.busy_ns, s.idle_ns, s.largest
      (27.0, 22.0, 5.0, (Gap(ns=5.0, before='a', after='b'),))
    """
    ordered = sorted(events, key=lambda e: (e.start_ns, e.end_ns))
    if not ordered:
        return GapSummary(num_kernels=0, span_ns=0.0, busy_ns=0.0, idle_ns=0.0, largest=())
    busy, gaps = 0.0, []
    run_start, run_end = float(ordered[0].start_ns), float(ordered[0].end_ns)
    last = ordered[0]
    for event in ordered[1:]:
        if event.start_ns > run_end:  # the device was idle from run_end to this start
            busy += run_end - run_start
            gaps.append(Gap(ns=event.start_ns - run_end, before=last.name, after=event.name))
            run_start = float(event.start_ns)
        if event.end_ns >= run_end:
            run_end, last = float(event.end_ns), event
    busy += run_end - run_start
    span = run_end - ordered[0].start_ns
    largest = tuple(sorted(gaps, key=lambda g: -g.ns)[:top])
    return GapSummary(
        num_kernels=len(ordered), span_ns=span, busy_ns=busy, idle_ns=span - busy, largest=largest
    )


def split_forwards(
    events: Sequence[KernelEvent], kernels_per_forward: int
) -> list[list[KernelEvent]]:
    """The timeline cut into consecutive forwards of `kernels_per_forward` kernels each (a
    trailing partial forward is dropped)."""
    if kernels_per_forward < 1:
        raise ValueError(f"{kernels_per_forward=} but at least 1 kernel per forward is needed")
    ordered = sorted(events, key=lambda e: e.start_ns)
    whole = len(ordered) // kernels_per_forward * kernels_per_forward
    return [ordered[i : i + kernels_per_forward] for i in range(0, whole, kernels_per_forward)]


def device_kernels(xplane_path: str) -> tuple[list[KernelEvent], str]:
    """Kernel events of the first GPU plane of a trace, and a description of what was read.

    Kernels are the events on the plane's "Stream #..." lines (XLA's and torch's launches on
    any stream). Returns ([], description of the planes and lines found) when there is none.
    """
    data = jax.profiler.ProfileData.from_file(xplane_path)
    seen = []
    for plane in data.planes:
        lines = list(plane.lines)
        seen.append(f"{plane.name}: {[line.name for line in lines][:8]}")
        if not plane.name.startswith("/device:GPU"):
            continue
        events = [
            KernelEvent(event.name, float(event.start_ns), float(event.duration_ns))
            for line in lines
            if line.name.startswith("Stream")
            for event in line.events
            if not event.name.lower().startswith(("memcpy", "memset"))
        ]
        if events:
            return events, f"{plane.name}, {len(events)} kernels"
    return [], "no GPU kernel events; planes: " + "; ".join(seen)


def _forward_fn(shape_name: str) -> tuple[Callable, tuple]:
    """The jitted FP8 `fused_moe` forward of a `bench` shape and its arguments."""
    from moe_jax.cli import layer_bench
    from moe_jax.fused_moe import fused_moe

    layer = layer_bench.make_layer(layer_bench.SHAPES[shape_name])
    fn = jax.jit(
        lambda x, w1, w2, tw, ti, s1, s2: fused_moe(x, w1, w2, tw, ti, w1_scale=s1, w2_scale=s2)
    )
    args = (layer.x, layer.w1q, layer.w2q, layer.topk_weights, layer.topk_ids, layer.w1s, layer.w2s)
    return fn, args


def _trace(fn: Callable, args: tuple, forwards: int, trace_dir: str) -> str:
    """Traces `forwards` back-to-back calls after warm-up; the path of the .xplane.pb."""
    for _ in range(3):  # compile, autotune, DeepGEMM's JIT: outside the trace
        jax.block_until_ready(fn(*args))
    with jax.profiler.trace(trace_dir):
        out = None
        for _ in range(forwards):
            out = None
            out = fn(*args)
        jax.block_until_ready(out)
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {trace_dir}")
    return max(paths, key=os.path.getmtime)


def _us(ns: float) -> str:
    return f"{ns / 1e3:.1f} us"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_jax.cli.kernel_gaps", description=__doc__)
    parser.add_argument("--shape", default="A", help="a `bench` shape: A, B or small")
    parser.add_argument("--forwards", type=int, default=10, help="back-to-back forwards traced")
    parser.add_argument("--json", help="also write the summary to this JSON file")
    args = parser.parse_args(argv)
    from moe_jax.cli import layer_bench

    if args.shape not in layer_bench.SHAPES:
        print(
            f"unknown shape {args.shape!r}; choose from {sorted(layer_bench.SHAPES)}",
            file=sys.stderr,
        )
        return 2
    if args.forwards < 2:
        print(f"--forwards {args.forwards}: at least 2 are needed", file=sys.stderr)
        return 2
    if jax.default_backend() != "gpu":
        print("needs a GPU: the CPU backend's trace has no device kernels", file=sys.stderr)
        return 2
    fn, args_ = _forward_fn(args.shape)
    with tempfile.TemporaryDirectory() as trace_dir:
        events, where = device_kernels(_trace(fn, args_, args.forwards, trace_dir))
    print(f"shape {args.shape}, {args.forwards} forwards traced: {where}")
    if not events or len(events) % args.forwards:
        print(
            f"{len(events)} kernel events do not split into {args.forwards} forwards: "
            "the whole timeline is summarized as one stretch",
            file=sys.stderr,
        )
        forwards = [events]
    else:
        forwards = split_forwards(events, len(events) // args.forwards)
    summaries = [summarize(f) for f in forwards]
    whole = summarize(events)
    span, busy, idle = (
        statistics.median(getattr(s, key) for s in summaries)
        for key in ("span_ns", "busy_ns", "idle_ns")
    )
    print(
        f"per forward (median of {len(summaries)}): {summaries[0].num_kernels} kernels, span "
        f"{_us(span)}, busy {_us(busy)}, idle {_us(idle)}"
    )
    print(f"whole trace: span {_us(whole.span_ns)}, idle {_us(whole.idle_ns)}; largest gaps:")
    for gap in whole.largest:
        print(f"  {_us(gap.ns):>10}  after {gap.before[:60]}  before {gap.after[:60]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    shape=args.shape,
                    source=where,
                    forwards=[dataclasses.asdict(s) for s in summaries],
                    whole=dataclasses.asdict(whole),
                ),
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
