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
    """The stage rows of `stage_breakdown.stage_breakdown`, with shares of their sum; with
    `forward_ms` (the one-jit forward's ms, `bench`'s moe_jax_fp8 row) also the gap: the forward
    minus the stages' sum, what the stage boundaries add or take away (negative where one jit
    overlaps or fuses what the stages run apart, positive where time goes between its kernels).

    Example:
      >>> print(format_breakdown("S", [dict(stage="a", ms=1.0), dict(stage="b", ms=3.0)], 3.5))
      stages of moe_jax_fp8, shape S (each jitted alone)
        a                           1.000 ms   25.0%
        b                           3.000 ms   75.0%
        sum                         4.000 ms
        forward (one jit)           3.500 ms
        forward - sum              -0.500 ms
    """
    total = sum(r["ms"] for r in rows)
    lines = [f"stages of moe_jax_fp8, shape {shape} (each jitted alone)"]
    if not rows:
        lines.append("  (experts='auto' is not the contiguous layout here: no stages to time)")
        return "\n".join(lines)
    for r in rows:
        lines.append(f"  {r['stage']:<24} {r['ms']:>8.3f} ms  {100 * r['ms'] / total:5.1f}%")
    lines.append(f"  {'sum':<24} {total:>8.3f} ms")
    if forward_ms is not None:
        lines.append(f"  {'forward (one jit)':<24} {forward_ms:>8.3f} ms")
        lines.append(f"  {'forward - sum':<24} {forward_ms - total:>+8.3f} ms")
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
