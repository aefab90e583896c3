"""`python -m benchmarks.kernel_gaps`: where a forward's device time goes, kernel by kernel.

Traces back-to-back FP8 layer forwards (`fused_moe(experts="auto")`, or another `--experts` name,
or one of `bench`'s FP8 variants with `--variant`, on `bench`'s shapes, or on `bench --decode`'s
DeepSeek-V3 experts with `--decode-tokens T`) with
`jax.profiler`, reads the GPU kernel events of the trace (`jax.profiler.ProfileData`), and
reports per forward: the span from first kernel start to last kernel end, the time some kernel
ran (busy), the idle rest (gaps), the largest gaps with the kernels on either side, and each
kernel's device time (median over the forwards). The traced calls are `bench`'s own timing
loop (`moe_jax.cli.timing`: host clock around bursts of back-to-back calls), so the bench's
figure and the device's span of the same calls sit side by side, burst by burst too. It also
prints the GPU's clock over the traced calls (`moe_jax.cli.gpu_clocks`: at its power cap the GPU
clocks down as it runs):

    python -m benchmarks.kernel_gaps --shape A --samples 5 [--json gaps.json]
    python -m benchmarks.kernel_gaps --decode-tokens 1 --plot stages.png
    python -m benchmarks.kernel_gaps --shape B --experts mosaic_fp8   # one GEMM backend
    python -m benchmarks.kernel_gaps --shape B --variant moe_jax_fp8_gathered

A gap is device idle time: the stream waits for the host (a slow launch, a torch callback's
Python, a synchronisation) or for an allocation. `stage_breakdown` gives each stage's times
jitted alone (by the host clock and, through `device_busy_ms`, by its kernels); this gives the
same forward's kernels and what lies between them. Needs a GPU (the CPU backend's trace has no
device kernels; the command says so and exits 2).
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

from moe_jax.cli import gpu_clocks

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


@dataclasses.dataclass(frozen=True)
class KernelTime:
    """One kernel's device time in a forward: the median over forwards of its summed duration
    (ns), and how many times it ran per forward."""

    name: str
    ns: float
    calls: int


def kernel_times(forwards: Sequence[Sequence[KernelEvent]]) -> list[KernelTime]:
    """Per kernel name: median over `forwards` of the summed duration in each, longest first.

    Example (two forwards; "b" runs twice in each):
      >>> f = [KernelEvent("a", 0, 4), KernelEvent("b", 4, 1), KernelEvent("b", 5, 2)]
      >>> g = [KernelEvent("a", 0, 6), KernelEvent("b", 6, 1), KernelEvent("b", 7, 1)]
      >>> kernel_times([f, g])
      [KernelTime(name='a', ns=5.0, calls=1), KernelTime(name='b', ns=2.5, calls=2)]
    """
    totals: dict[str, list[float]] = {}
    calls: dict[str, int] = {}
    for index, forward in enumerate(forwards):
        for event in forward:
            per_forward = totals.setdefault(event.name, [0.0] * len(forwards))
            per_forward[index] += event.duration_ns
            if index == 0:
                calls[event.name] = calls.get(event.name, 0) + 1
    rows = [
        KernelTime(name, statistics.median(v), calls.get(name, 0)) for name, v in totals.items()
    ]
    return sorted(rows, key=lambda r: -r.ns)


# Stages of the FP8 forward by kernel name, first match wins (unpermute before permute).
STAGES = (
    # DeepGEMM's, the Pallas grouped GEMM, XLA's cuBLAS calls, and Mosaic GPU kernels (in
    # moe_jax only its grouped GEMMs, which the profile names "anonymous_mosaic_gpu_kernel")
    ("GEMMs", ("gemm", "mosaic_gpu")),
    ("act*up + quantize", ("act_quant",)),
    ("unpermute", ("unpermute",)),
    ("permute", ("permute",)),
    ("quantize x", ("group_quant",)),
)
OTHER_STAGE = "routing metadata, other XLA ops"


def stage_of(name: str) -> str:
    """The forward stage a kernel belongs to (`STAGES`), else `OTHER_STAGE`.

    >>> stage_of("unpermute_config_block_t_2"), stage_of("loop_select_fusion")
    ('unpermute', 'routing metadata, other XLA ops')
    """
    lowered = name.lower()
    for stage, keys in STAGES:
        if any(key in lowered for key in keys):
            return stage
    return OTHER_STAGE


def stage_times(times: Sequence[KernelTime]) -> dict[str, float]:
    """Device ns per forward summed by `stage_of`, in `STAGES` order then the other stage."""
    totals = {stage: 0.0 for stage, _ in STAGES} | {OTHER_STAGE: 0.0}
    for row in times:
        totals[stage_of(row.name)] += row.ns
    return totals


def plot_stages(label: str, stages: dict[str, float], host_us: float, path: str) -> None:
    """A horizontal bar per stage (us per forward), titled with the host clock per call."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(stages)
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(names) + 1.2))
    ax.barh(names[::-1], [stages[n] / 1e3 for n in names[::-1]])
    ax.set_xlabel("device us per forward")
    ax.set_title(f"{label}: host clock {host_us:.0f} us per call")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def short_name(name: str, template_args: int = 4) -> str:
    """A kernel name for a table: "void " dropped, a C++ template's arguments cut to the first
    `template_args` (DeepGEMM's GEMMs differ in their N and K arguments).

      >>> short_name("void ns::gemm<(M)0, 0u, 4096u, 7168u, 32u>(float*, int*)")
      'ns::gemm<(M)0, 0u, 4096u, 7168u, ...>'
      >>> short_name("loop_add_fusion")
      'loop_add_fusion'
    """
    name = name.removeprefix("void ")
    if "<" not in name:
        return name
    base, rest = name.split("<", 1)
    args = rest.split(">")[0].split(", ")
    more = ", ..." if len(args) > template_args else ""
    return f"{base}<{', '.join(args[:template_args])}{more}>"


def is_kernel(plane: str, line: str, name: str) -> bool:
    """Whether a profile event is a kernel: on a GPU plane's "Stream ..." line (XLA's and
    torch's launches on any stream), not a copy or a memset.

    >>> is_kernel("/device:GPU:0", "Stream #14(Compute)", "permute"), is_kernel(
    ...     "/device:GPU:0", "Stream #14(Compute)", "MemcpyD2D")
    (True, False)
    """
    return (
        plane.startswith("/device:GPU")
        and line.startswith("Stream")
        and not name.lower().startswith(("memcpy", "memset"))
    )


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
            for event in line.events
            if is_kernel(plane.name, line.name, event.name)
        ]
        if events:
            return events, f"{plane.name}, {len(events)} kernels"
    return [], "no GPU kernel events; planes: " + "; ".join(seen)


def layer_args_error(shape_name: str, experts: str) -> str | None:
    """What is wrong with a `bench` shape and `fused_moe(experts=...)` name given on the
    command line (the message names the choices), or None."""
    from moe_jax.cli import layer_bench
    from moe_jax.experts_by_name import experts_names

    if shape_name not in layer_bench.SHAPES:
        return f"unknown shape {shape_name!r}; choose from {sorted(layer_bench.SHAPES)}"
    if experts not in experts_names():
        return f"unknown --experts {experts!r}; choose from {list(experts_names())}"
    return None


def variant_error(variant: str) -> str | None:
    """What is wrong with a `bench` FP8 variant named on the command line, or None."""
    from moe_jax.cli import layer_bench

    if variant not in layer_bench.FP8_VARIANTS:
        return f"unknown --variant {variant!r}; choose from {list(layer_bench.FP8_VARIANTS)}"
    return None


def forward_fn(
    shape_name: str, experts: str = "auto", *, variant: str | None = None
) -> tuple[Callable, tuple]:
    """The jitted FP8 `fused_moe(experts=experts)` forward of a `bench` shape and its arguments;
    with `variant`, that `bench` FP8 variant's forward instead (`layer_bench.FP8_VARIANTS`).

    Raises:
      RuntimeError: the variant cannot run here (the message says why).
    """
    from moe_jax.cli import layer_bench
    from moe_jax.fused_moe import fused_moe

    layer = layer_bench.make_layer(layer_bench.SHAPES[shape_name])
    if variant is not None:
        built = layer_bench.jax_variant(variant, layer)
        if isinstance(built, str):
            raise RuntimeError(f"variant {variant}: {built}")
        return built
    fn = jax.jit(
        lambda x, w1, w2, tw, ti, s1, s2: fused_moe(
            x, w1, w2, tw, ti, w1_scale=s1, w2_scale=s2, experts=experts
        )
    )
    args = (layer.x, layer.w1q, layer.w2q, layer.topk_weights, layer.topk_ids, layer.w1s, layer.w2s)
    return fn, args


def _decode_forward_fn(num_tokens: int, experts: str = "auto") -> tuple[Callable, tuple]:
    """The jitted FP8 `fused_moe(experts=experts)` forward of `bench --decode` (DeepSeek-V3
    experts on one GPU) at `num_tokens` tokens, and its arguments."""
    from moe_jax.cli import decode_bench

    shape = decode_bench.SHAPES["deepseek_v3"]
    weights = decode_bench.make_weights(shape)
    x, topk_weights, topk_ids = decode_bench.make_tokens(shape, num_tokens)
    return decode_bench.layer_fn(experts), (x, weights, topk_weights, topk_ids)


def _warm_up(fn: Callable, args: tuple, calls: int = 3) -> None:
    """Runs `fn(*args)` `calls` times, each waited for, so compilation, XLA's autotuning and
    DeepGEMM's JIT happen before a trace starts."""
    for _ in range(calls):
        jax.block_until_ready(fn(*args))


def _trace(fn: Callable, args: tuple, samples: int, burst: int, trace_dir: str):
    """Times `fn(*args)` as `bench` does (`timing.time_calls`: `samples` bursts of `burst`
    back-to-back calls after its warm-up calls) inside a `jax.profiler` trace, so the host's
    figure and the device timeline come from the same calls. Returns (the .xplane.pb path,
    the `timing.Timing`, the GPU clock's `gpu_clocks.ClockSummary` over the traced calls or
    None)."""
    from moe_jax.cli import timing

    _warm_up(fn, args)
    with (
        gpu_clocks.ClockMonitor() as clocks,
        jax.profiler.trace(trace_dir, profiler_options=profiler_options()),
    ):
        measured = timing.time_calls(
            lambda: fn(*args), wait=jax.block_until_ready, samples=samples, burst=burst
        )
    return latest_xplane(trace_dir), measured, clocks.summary


def device_busy_ms(fn: Callable, args: tuple, *, calls: int = 10) -> float | None:
    """Device time (ms) per call of `fn(*args)`: the time some kernel ran (`summarize`'s busy
    time) over `calls` calls, each waited for, traced with `jax.profiler` after 3 untraced
    calls, divided by `calls`. None, with nothing run, where no array in `args` is on a GPU
    (the CPU backend, or interpret-mode kernels on a GPU host's CPU device), and where the
    trace holds no GPU kernels.

    What a stage costs the device, apart from the host's launch: a small program jitted alone
    is bound by its dispatch (about 0.1 ms a call on the H100 host, 2026-12-07), not its
    kernels, so its host-clock time says little of its share of a forward.
    """
    if calls < 1:
        raise ValueError(f"{calls=}: at least 1 call is needed")
    arrays = [leaf for leaf in jax.tree.leaves(args) if isinstance(leaf, jax.Array)]
    if not any(device.platform == "gpu" for a in arrays for device in a.devices()):
        return None
    _warm_up(fn, args)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, profiler_options=profiler_options()):
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        events, _ = device_kernels(latest_xplane(trace_dir))
    if not events:
        return None
    return summarize(events).busy_ns / calls / 1e6


def profiler_options() -> jax.profiler.ProfileOptions:
    """The trace's options: no Python tracer, which made each call's host dispatch a third
    longer (shape B on the H200, 2026-12-04: 340 -> about 450 us), and with it each lead-in."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    return options


def latest_xplane(trace_dir: str) -> str:
    """The newest .xplane.pb a `jax.profiler.trace(trace_dir)` wrote."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {trace_dir}")
    return max(paths, key=os.path.getmtime)


def burst_spans(forwards: Sequence[Sequence[KernelEvent]], burst: int) -> list[float]:
    """Device span per call (ns) of each burst of `burst` consecutive forwards: first kernel
    start to last kernel end, divided by `burst` (the device's view of a streamed sample).

      >>> f = [[KernelEvent("a", 10 * i, 4)] for i in range(4)]
      >>> burst_spans(f, 2)
      [7.0, 7.0]
    """
    spans = []
    for start in range(0, len(forwards) - burst + 1, burst):
        events = [e for forward in forwards[start : start + burst] for e in forward]
        first = min(e.start_ns for e in events)
        spans.append((max(e.end_ns for e in events) - first) / burst)
    return spans


def _us(ns: float) -> str:
    return f"{ns / 1e3:.1f} us"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernel_gaps", description=__doc__)
    parser.add_argument("--shape", default="A", help="a `bench` shape: A, B or small")
    parser.add_argument(
        "--decode-tokens",
        type=int,
        help="profile `bench --decode`'s DeepSeek-V3 layer at this many tokens instead of --shape",
    )
    parser.add_argument(
        "--experts",
        default="auto",
        help=(
            "`fused_moe(experts=...)`: auto, a GEMM backend (contiguous layout), <gemm>_masked, "
            "or <gemm>+<fused> (GEMM1 fused with act + quantization)"
        ),
    )
    parser.add_argument(
        "--variant",
        help=(
            "a `bench` FP8 variant (e.g. moe_jax_fp8_gathered) instead of --experts; "
            "not with --decode-tokens"
        ),
    )
    parser.add_argument("--top-kernels", type=int, default=12, help="kernels listed by time")
    parser.add_argument(
        "--samples", type=int, default=5, help="timed bursts traced (each of --burst calls)"
    )
    parser.add_argument("--burst", type=int, default=10, help="back-to-back calls per burst")
    parser.add_argument("--json", help="also write the summary to this JSON file")
    parser.add_argument("--plot", help="also write a PNG of the device time by stage")
    args = parser.parse_args(argv)
    error = layer_args_error(args.shape, args.experts)
    if args.variant is not None:
        error = error or variant_error(args.variant)
        if args.decode_tokens is not None or args.experts != "auto":
            error = error or "--variant takes neither --decode-tokens nor --experts"
    if error:
        print(error, file=sys.stderr)
        return 2
    if args.decode_tokens is not None and args.decode_tokens < 1:
        print(f"--decode-tokens {args.decode_tokens}: at least 1 is needed", file=sys.stderr)
        return 2
    if args.samples < 1 or args.burst < 2:
        print(
            f"--samples {args.samples} --burst {args.burst}: at least 1 sample of 2 calls",
            file=sys.stderr,
        )
        return 2
    if jax.default_backend() != "gpu":
        print("needs a GPU: the CPU backend's trace has no device kernels", file=sys.stderr)
        return 2
    from moe_jax.cli import timing

    if args.decode_tokens is not None:
        label = f"decode T={args.decode_tokens}"
        fn, args_ = _decode_forward_fn(args.decode_tokens, args.experts)
    else:
        label = f"shape {args.shape}"
        try:
            fn, args_ = forward_fn(args.shape, args.experts, variant=args.variant)
        except RuntimeError as error:  # a variant that cannot run here says why
            print(error, file=sys.stderr)
            return 2
    if args.experts != "auto":
        label += f", experts={args.experts}"
    if args.variant is not None:
        label += f", variant {args.variant}"
    timed = args.samples * args.burst
    traced = timing.WARMUP + timed  # time_calls' own warm-up calls run inside the trace too
    with tempfile.TemporaryDirectory() as trace_dir:
        path, measured, clocks = _trace(fn, args_, args.samples, args.burst, trace_dir)
        events, where = device_kernels(path)
    print(f"{label}, {traced} calls traced ({args.samples} bursts of {args.burst}): {where}")
    if not events or len(events) % traced:
        print(
            f"{len(events)} kernel events do not split into {traced} forwards: "
            "the whole timeline is summarized as one stretch",
            file=sys.stderr,
        )
        forwards = [events]
        spans = []
    else:
        forwards = split_forwards(events, len(events) // traced)[timing.WARMUP :]
        spans = burst_spans(forwards, args.burst)
    host_us = measured.streamed_ms * 1e3
    device_us = statistics.median(spans) / 1e3 if spans else float("nan")
    if spans:
        print(
            "per call, burst by burst, us: host clock "
            + ", ".join(f"{ms * 1e3:.0f}" for ms in measured.streamed_samples_ms)
            + "; device span "
            + ", ".join(f"{ns / 1e3:.0f}" for ns in spans)
        )
    print(
        f"per call, back to back: host clock {host_us:.1f} us (`bench`'s figure), device span "
        f"{device_us:.1f} us (median of {len(spans)} bursts; the difference is the host's "
        "lead-in and wake-up per burst plus the device's idle time between calls)"
    )
    summaries = [summarize(f) for f in forwards]
    whole = summarize([event for forward in forwards for event in forward])
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
    times = kernel_times(forwards)
    print(f"device time per forward by kernel (median of {len(forwards)} forwards):")
    for row in times[: args.top_kernels]:
        share = row.ns / busy if busy else 0.0
        print(f"  {_us(row.ns):>10} {share:6.1%}  x{row.calls:<2} {short_name(row.name)[:90]}")
    rest = times[args.top_kernels :]
    if rest:
        print(f"  {_us(sum(r.ns for r in rest)):>10}          {len(rest)} other kernels")
    stages = stage_times(times)
    print("by stage: " + ", ".join(f"{name} {_us(ns)}" for name, ns in stages.items()))
    if clocks is not None:
        print(f"GPU during the traced calls: {clocks.line()}")
    if args.plot:
        plot_stages(label, stages, host_us, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    shape=label,
                    host_us=host_us,
                    device_span_us=device_us,
                    kernels=[dataclasses.asdict(t) for t in times],
                    stages_ns=stages,
                    source=where,
                    forwards=[dataclasses.asdict(s) for s in summaries],
                    whole=dataclasses.asdict(whole),
                    clocks=None if clocks is None else dataclasses.asdict(clocks),
                ),
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
