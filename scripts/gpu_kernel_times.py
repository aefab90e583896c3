"""Per-kernel device times and counters of one moe_jax FP8 layer forward, for `ncu` (a development
tool).

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \
        --csv --page raw python3 scripts/gpu_kernel_times.py A > kernels_A.csv
    python3 scripts/gpu_kernel_times.py --summarize kernels_A.csv

Only the last forward (after warm-up) is inside the profiled range. `--experts NAME` runs the layer
with that experts backend (`moe_jax.experts_names()`; "auto" by default), e.g.
"deep_gemm+mosaic_fp8" for the fused Mosaic GEMM1; `--variant NAME` runs one of `bench`'s FP8
variants instead (`layer_bench.FP8_VARIANTS`), e.g. "moe_jax_fp8_gathered". `--summarize` prints
the metrics ncu wrote, kernel by kernel (the kernel time in us, counters as counted; `--columns
REGEX` keeps the matching ones), and the sum over the kernels of each additive one, so one command
compares, say, the shared-memory bank conflicts of two kernels (`bash scripts/gpu_check.sh
epilogue`).
`--sass` reads ncu's source page of one kernel (`ncu --import R.ncu-rep --page source --csv
--print-source sass`, with the SourceCounters section collected) and says where its warps' stall
samples sit: by loop level (instructions grouped by how often they ran: once per K step, once
per tile, ...), by opcode within a level, and the instructions with the most samples.
"""

from __future__ import annotations

import argparse
import collections
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


def profile(shape_name: str, experts: str, variant: str | None = None) -> None:
    """Runs the FP8 layer of `layer_bench.SHAPES[shape_name]` with `experts` (or `bench`'s FP8
    variant `variant`) three times, then once inside the CUDA profiler's range (what `ncu
    --profile-from-start off` records)."""
    import jax
    import torch

    from moe_jax.cli import kernel_gaps

    fn, args = kernel_gaps.forward_fn(shape_name, experts, variant=variant)
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


_SAMPLES = "Warp Stall Sampling (All Samples)"
_EXECUTED = "Instructions Executed"


def _opcode(source: str) -> str:
    """A SASS line's opcode with its modifiers, predicate dropped: "@!P2 BRA 0x7f" -> "BRA"."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def sass_summary(path: str, *, levels: int = 4, opcodes: int = 8, top: int = 12) -> list[str]:
    """Where one kernel's warp-stall samples sit, from ncu's source page CSV at `path`.

    The instructions are grouped by their execution count: in a loop-structured kernel each
    count is one loop level (in the Mosaic GEMM, the count of the K-step body, of the
    per-tile epilogue, of the memory warpgroup's per-tile code). Lines: the `levels` groups
    with the most samples (share of all samples, instructions, issued), the `opcodes`
    opcodes with the most samples in each, then the `top` instructions with the most
    samples and each one's two largest stall reasons. Returns the lines.
    """
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    header = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if header is None:
        raise ValueError(f"{path}: no SASS rows (was it ncu --page source --print-source sass?)")
    rows = list(csv.DictReader(lines[header:]))
    if not rows or _SAMPLES not in rows[0] or _EXECUTED not in rows[0]:
        raise ValueError(f"{path}: no stall samples (collect --section SourceCounters)")
    stalls = [n for n in rows[0] if n.startswith("stall_") and "Not Issued" not in n]
    samples = [_number(row[_SAMPLES]) or 0.0 for row in rows]
    executed = [_number(row[_EXECUTED]) or 0.0 for row in rows]
    total = sum(samples) or 1.0
    by_level = collections.defaultdict(list)
    for i, count in enumerate(executed):
        by_level[count].append(i)
    out = [f"{len(rows)} instructions, {sum(samples):.0f} stall samples"]
    ranked = sorted(by_level.items(), key=lambda kv: -sum(samples[i] for i in kv[1]))
    for count, members in ranked[:levels]:
        level_samples = sum(samples[i] for i in members)
        out.append(
            f"run {count:.0f} times: {100 * level_samples / total:5.1f}% of samples, "
            f"{len(members)} instructions, {count * len(members):.3g} issued"
        )
        per_opcode = collections.Counter()
        for i in members:
            per_opcode[_opcode(rows[i]["Source"])] += samples[i]
        top_opcodes = per_opcode.most_common(opcodes)
        out += [f"  {op:<40} {100 * value / total:5.1f}%" for op, value in top_opcodes]
    out.append(f"the {top} instructions with the most samples (index, share, runs, reasons):")
    for i in sorted(range(len(rows)), key=lambda i: -samples[i])[:top]:
        reasons = sorted(stalls, key=lambda n: -(_number(rows[i][n]) or 0.0))[:2]
        named = ", ".join(f"{n[len('stall_') :]} {_number(rows[i][n]) or 0:.0f}" for n in reasons)
        out.append(
            f"  {i:6d} {100 * samples[i] / total:5.1f}% {executed[i]:10.0f}  "
            f"{rows[i]['Source'].strip()[:60]:<60} {named}"
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", nargs="?", help="a layer_bench shape (A, B, ...)")
    parser.add_argument("--experts", default="auto", help="experts backend of the layer")
    parser.add_argument(
        "--variant",
        help="profile this `bench` FP8 variant's forward instead (e.g. moe_jax_fp8_gathered)",
    )
    parser.add_argument("--summarize", metavar="CSV", help="print the metrics of an ncu CSV")
    parser.add_argument(
        "--columns", metavar="REGEX", help="with --summarize: only the metrics matching REGEX"
    )
    parser.add_argument(
        "--sass", metavar="CSV", help="where a kernel's stall samples sit, from ncu's source page"
    )
    args = parser.parse_args(argv)
    if args.sass:
        print("\n".join(sass_summary(args.sass)))
    elif args.summarize:
        print("\n".join(summarize(args.summarize, args.columns)))
    elif args.shape:
        if args.variant is not None:
            from moe_jax.cli import kernel_gaps

            if args.experts != "auto":
                parser.error("--variant chooses the forward's experts itself: drop --experts")
            if error := kernel_gaps.variant_error(args.variant):
                parser.error(error)
        profile(args.shape, args.experts, args.variant)
    else:
        parser.error("give a shape to profile, --summarize CSV or --sass CSV")


if __name__ == "__main__":
    main()
