"""Tables, the bar chart and the environment line of `python -m moe_jax bench`."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import jax

from moe_jax.cli import gpu_clocks


def format_table(rows: list[dict]) -> str:
    """One line per (shape, variant) row of `layer_bench.run`: times, TFLOPS, ratio, error."""
    width = max([22, *(len(r["variant"]) for r in rows)])  # the variant column fits every name
    header = (
        f"{'shape':<6} {'variant':<{width}} {'ms':>9} {'TFLOPS':>8} {'x best base':>11}"
        f" {'rel. err':>9} {'latency ms':>10} {'1st call s':>10}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        if "ms" not in r:
            lines.append(f"{r['shape']:<6} {r['variant']:<{width}} skipped: {r['skipped']}")
            continue
        ratio = f"{r['vs_best_baseline']:.2f}" if "vs_best_baseline" in r else "-"
        first = f"{r['first_call_s']:.1f}" if "first_call_s" in r else "-"
        lines.append(
            f"{r['shape']:<6} {r['variant']:<{width}} {r['ms']:>9.3f} {r['tflops']:>8.1f} "
            f"{ratio:>11} {r['rel_err']:>9.2e} {r['latency_ms']:>10.3f} {first:>10}"
        )
    lines.append(
        "ms: per forward, 10 calls back to back (host ahead, as in a model); latency: one "
        "call waited for. x best base: best baseline ms / ms. 1st call s: the first call, "
        "compilation included (not where this process compiled the same program before)."
    )
    clocks = [r for r in rows if r.get("clocks")]
    if clocks:
        lines.append("GPU while timed (nvidia-smi every 50 ms; a slowed GPU times slower):")
        for r in clocks:
            summary = gpu_clocks.ClockSummary(**r["clocks"])
            lines.append(f"  {r['shape']:<6} {r['variant']:<{width}} {summary.line()}")
    return "\n".join(lines)


def format_breakdown(shape: object, rows: list[dict], forward_ms: float | None = None) -> str:
    """The stage rows of `stage_breakdown.stage_breakdown`: each stage's host-clock ms and, where
    measured (a GPU), its device ms, with shares of the device sum (of the host sum where a
    stage has no device time). With `forward_ms` (the one-jit forward's ms, `bench`'s
    moe_jax_fp8 row) also the gap: the forward minus each sum. Against the host sum it is what
    the jit boundaries add or take away (negative where the stages alone wait on their launch);
    against the device sum, the time the forward spends beyond its kernels' work.

    Example:
      >>> rows = [dict(stage="a", ms=1.0, device_ms=0.5), dict(stage="b", ms=3.0, device_ms=1.5)]
      >>> print(format_breakdown("S", rows, 3.5))
      stages of moe_jax_fp8, shape S (each jitted alone)
        stage                                               host ms  device ms   share
        a                                                     1.000      0.500   25.0%
        b                                                     3.000      1.500   75.0%
        sum                                                   4.000      2.000
        forward (one jit)                                     3.500
        forward - sum                                        -0.500     +1.500
    """
    width = 48
    lines = [f"stages of moe_jax_fp8, shape {shape} (each jitted alone)"]
    if not rows:
        lines.append("  (experts='auto' is not the contiguous layout here: no stages to time)")
        return "\n".join(lines)
    lines.append(f"  {'stage':<{width}}    host ms  device ms   share")
    host_total = sum(r["ms"] for r in rows)
    device = [r.get("device_ms") for r in rows]
    device_total = None if None in device else sum(device)
    share_total = host_total if device_total is None else device_total

    def device_cell(ms: float | None, sign: str = "") -> str:
        return f"{'-':>10}" if ms is None else f"{ms:>{sign}10.3f}"

    for r, dev in zip(rows, device, strict=True):
        share = r["ms"] if device_total is None else dev
        lines.append(
            f"  {r['stage']:<{width}} {r['ms']:>10.3f} {device_cell(dev)} "
            f"{100 * share / share_total:6.1f}%"
        )
    lines.append(f"  {'sum':<{width}} {host_total:>10.3f} {device_cell(device_total)}")
    if forward_ms is not None:
        lines.append(f"  {'forward (one jit)':<{width}} {forward_ms:>10.3f}")
        device_gap = None if device_total is None else forward_ms - device_total
        lines.append(
            f"  {'forward - sum':<{width}} {forward_ms - host_total:>+10.3f} "
            f"{device_cell(device_gap, '+')}"
        )
    return "\n".join(lines)


def plot(
    rows: list[dict],
    path: str,
    *,
    shapes: Mapping[str, object],
    baselines: Sequence[str],
    value_key: str = "ms",
    xlabel: str = "ms per layer forward, lower is better",
) -> None:
    """Bar chart of `row[value_key]` per variant (baselines grey), one panel per shape in the
    order the rows name them (log scale where a panel spans more than 20x), written as PNG. Rows
    without the value are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, shape in zip(axes[0], names, strict=True):
        timed = [r for r in rows if r["shape"] == shape and value_key in r]
        values = [r[value_key] for r in timed]
        colors = ["tab:gray" if r["variant"] in baselines else "tab:blue" for r in timed]
        bars = ax.barh([r["variant"] for r in timed], values, color=colors)
        ax.bar_label(bars, labels=[f"{v:.2f} ms" for v in values], padding=3, fontsize=8)
        # Log scale only where the times span more than 20x (bars on a log axis start at its
        # left edge, so their lengths only compare on a linear one).
        is_log = bool(values) and max(values) > 20 * min(values)
        if is_log:
            ax.set_xscale("log")
            ax.set_xlim(right=2 * max(values))  # room for the labels
        else:
            ax.set_xlim(0, 1.2 * max(values, default=1.0))
        ax.set_xlabel(xlabel + (" (log scale)" if is_log else ""))
        ax.set_title(f"{shapes[shape]} on {jax.devices()[0].device_kind}", fontsize=9)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment() -> dict:
    """jax version, backend, device, date, and torch / deep_gemm versions where installed."""
    info = dict(
        jax=jax.__version__,
        backend=jax.default_backend(),
        device=jax.devices()[0].device_kind,
        date=time.strftime("%Y-%m-%d"),
    )
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        import deep_gemm

        info["deep_gemm"] = getattr(deep_gemm, "__version__", "unknown")
    except ImportError:
        pass
    return info
