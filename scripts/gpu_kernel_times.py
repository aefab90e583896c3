"""Per-kernel device times and counters of one moe_jax FP8 layer forward, for `ncu` (a development
tool).

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \
        --csv --page raw python3 scripts/gpu_kernel_times.py A > kernels_A.csv
    python3 scripts/gpu_kernel_times.py --summarize kernels_A.csv

Only the last forward (after warm-up) is inside the profiled range. `--experts NAME` runs the
layer with that experts backend (`moe_jax.experts_names()`; "auto" by default), e.g.
"deep_gemm+mosaic_fp8" for the fused Mosaic GEMM1. `--summarize` prints the metrics ncu wrote,
kernel by kernel (the kernel time in us, counters as counted; `--columns REGEX` keeps the
matching ones), and the sum over the kernels of each additive one, so one command compares,
say, the shared-memory bank conflicts of two kernels (`bash scripts/gpu_check.sh epilogue`).
"""

from __future__ import annotations

import argparse
import csv
import re

# ncu columns that name or place a kernel rather than measure it
_NON_METRIC_COLUMNS = {
    "ID",
    "Process ID",
    "Process Name",
    "Host Name",
    "Kernel Name",
    "Context",
    "Stream",
    "Block Size",
    "Grid Size",
    "Device",
    "CC",
}
_TIME = "gpu__time_duration.sum"  # printed in us, whatever unit ncu chose
_US_PER_UNIT = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}


def profile(shape_name: str, experts: str) -> None:
    """Runs the FP8 layer of `layer_bench.SHAPES[shape_name]` with `experts` three times, then
    once inside the CUDA profiler's range (what `ncu --profile-from-start off` records)."""
    import jax
    import torch

    from moe_jax.cli import layer_bench
    from moe_jax.fused_moe import fused_moe

    layer = layer_bench.make_layer(layer_bench.SHAPES[shape_name])
    fn = jax.jit(
        lambda x, w1, w2, tw, ti, s1, s2: fused_moe(
            x, w1, w2, tw, ti, w1_scale=s1, w2_scale=s2, experts=experts
        )
    )
    args = (layer.x, layer.w1q, layer.w2q, layer.topk_weights, layer.topk_ids, layer.w1s, layer.w2s)
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    jax.block_until_ready(fn(*args))
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _number(text: str) -> float | None:
    """An ncu CSV cell as a float (thousands separators removed), None if not a number."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _format(name: str, value: float) -> str:
    """The time with 0.1 us, counts whole, ratios and percentages with 3 decimals."""
    if name == _TIME:
        return f"{value:.1f}"
    if name.endswith(".sum") and value == int(value):
        return f"{int(value)}"
    return f"{value:.3f}"


def _label(name: str) -> str:
    """A metric's name as printed: the kernel time as "us"."""
    return "us" if name == _TIME else name


def summarize(path: str, columns: str | None = None) -> list[str]:
    """The metrics of `ncu --csv --page raw` output at `path`, kernel by kernel (a block of
    "metric value" lines each, gpu__time_duration.sum as "us"), then the sum over the kernels
    of the time and of each count (.sum). `columns`: a regular expression the metric names
    must match (`re.search`); None keeps all (a section run writes hundreds). Returns the lines.
    """
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own log lines are not
    rows = list(csv.DictReader(lines))
    if not rows:
        raise ValueError(f"{path}: no ncu CSV rows (was ncu run with --csv --page raw?)")
    pattern = re.compile(columns or "")
    metrics = [n for n in rows[0] if n not in _NON_METRIC_COLUMNS and pattern.search(n)]
    if not metrics:
        raise ValueError(f"{path}: no metric column matches {columns!r}")
    units = rows[0] if rows[0]["ID"] == "" else {}  # ncu's second line: each column's unit
    kernels = rows[1:] if units else rows
    to_us = _US_PER_UNIT.get(units.get(_TIME, "nsecond"), 1e-3)
    width = max(len(name) for name in metrics)
    totals = dict.fromkeys(metrics, 0.0)
    out = []
    for row in kernels:
        out.append(row["Kernel Name"])
        for name in metrics:
            value = _number(row[name])
            if value is None:
                out.append(f"  {_label(name):<{width}} {row[name]:>14}")
                continue
            value = value * to_us if name == _TIME else value
            totals[name] += value
            out.append(f"  {_label(name):<{width}} {_format(name, value):>14}")
    # sums of ratios and averages mean nothing: only counts (.sum) and the time are added up
    out.append("sum over the kernels")
    out += [
        f"  {_label(name):<{width}} {_format(name, totals[name]):>14}"
        for name in metrics
        if name.endswith(".sum")
    ]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", nargs="?", help="a layer_bench shape (A, B, ...)")
    parser.add_argument("--experts", default="auto", help="experts backend of the layer")
    parser.add_argument("--summarize", metavar="CSV", help="print the metrics of an ncu CSV")
    parser.add_argument(
        "--columns", metavar="REGEX", help="with --summarize: only the metrics matching REGEX"
    )
    args = parser.parse_args(argv)
    if args.summarize:
        print("\n".join(summarize(args.summarize, args.columns)))
    elif args.shape:
        profile(args.shape, args.experts)
    else:
        parser.error("give a shape to profile, or --summarize CSV")


if __name__ == "__main__":
    main()
