"""Tables, the bar chart and the environment line of `python -m moe_jax bench`."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence

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
    notes: dict[str, int] = {}
    for r in rows:
        if "ms" not in r:
            lines.append(f"{r['shape']:<6} {r['variant']:<{width}} {skip_note(r, notes)}")
            continue
        ratio = f"{r['vs_best_baseline']:.2f}" if "vs_best_baseline" in r else "-"
        first = f"{r['first_call_s']:.1f}" if "first_call_s" in r else "-"
        lines.append(
            f"{r['shape']:<6} {r['variant']:<{width}} {r['ms']:>9.3f} {r['tflops']:>8.1f} "
            f"{ratio:>11} {r['rel_err']:>9.2e} {r['latency_ms']:>10.3f} {first:>10}"
        )
    lines += note_lines(notes)
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


def skip_reason(error: BaseException, limit: int = 300) -> str:
    """Why a variant did not run, in one line of at most `limit` characters: a refusal's reasons
    by backend name (`NoImplementationError.refusals`), else the error's type and text."""
    refusals = getattr(error, "refusals", None)  # NoImplementationError: name -> reason
    if refusals:
        text = "; ".join(f"{name}: {why}" for name, why in refusals.items())
    else:
        text = f"{type(error).__name__}: {error}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def skip_note(row: dict, notes: dict[str, int]) -> str:
    """The cell "skipped [n]" of a skipped row: n numbers its reason in `notes` (reason -> n, in
    order of first use), so a reason several rows share is printed once, below the table."""
    reason = " ".join(str(row["skipped"]).split())  # one line
    return f"skipped [{notes.setdefault(reason, len(notes) + 1)}]"


def note_lines(notes: dict[str, int]) -> list[str]:
    """The lines "[n] reason" of `skip_note`'s notes."""
    return [f"[{number}] {reason}" for reason, number in notes.items()]


def column_table(rows, columns, lead_header: str, lead, min_width: int) -> list[str]:
    """A table's lines: `lead_header` + a column per (row key, header, format) of `columns`
    (at least `min_width` wide), a row per `rows` item starting with `lead(row)`; a skipped row
    shows `skip_note`, its reasons listed once below (`note_lines`)."""
    widths = [max(min_width, len(header)) for _, header, _ in columns]
    header = lead_header + "".join(
        f" {title:>{w}}" for (_, title, _), w in zip(columns, widths, strict=True)
    )
    lines, notes = [header, "-" * len(header)], {}
    for row in rows:
        if "skipped" in row:
            lines.append(f"{lead(row)} {skip_note(row, notes)}")
            continue
        cells = [
            f"{row[key]:>{w}{form}}" if key in row else f"{'-':>{w}}"
            for (key, _, form), w in zip(columns, widths, strict=True)
        ]
        lines.append(lead(row) + "".join(f" {cell}" for cell in cells))
    return lines + note_lines(notes)


def missing_plot_dependency() -> str | None:
    """Why `--plot` cannot draw here (matplotlib missing, with the extra that installs it), or
    None: checked before a benchmark runs, not after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        return (
            f"--plot needs matplotlib ({error}): install it with pip install -e '.[notebooks]' "
            "from the repository, or pip install matplotlib"
        )
    return None


def write_outputs(
    result: dict, *, json_path: str | None, plot_path: str | None, draw: Callable[[str], None]
) -> int:
    """Writes `result` to `json_path` as JSON, then the plot (`draw(plot_path)`); returns the exit
    status. The JSON comes first and stays written if the plot fails: the failure is printed to
    stderr and the status is 1."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    if plot_path:
        try:
            draw(plot_path)
        except Exception as error:  # the measurements are kept whatever the plot does
            kept = f"; the results are in {json_path}" if json_path else ""
            print(
                f"--plot {plot_path} failed: {type(error).__name__}: {error}{kept}", file=sys.stderr
            )
            return 1
        print(f"wrote {plot_path}")
    return 0


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
