"""Rows and the markdown table of `python -m benchmarks.kernel_bench`."""

from __future__ import annotations

import math


def row(
    kernel: str,
    shape: str,
    dtype: str,
    *,
    us: float,
    copy_gbs: float,
    xla_us: float | None = None,
    moved: int = 0,
    check: str = "",
    config: str = "",
) -> dict:
    """One table row; `moved` bytes give GB/s and the share of the copy bandwidth."""
    gbs = moved / us / 1e3 if moved else math.nan
    return dict(
        kernel=kernel,
        shape=shape,
        dtype=dtype,
        us=us,
        gbs=gbs,
        pct=100 * gbs / copy_gbs,
        xla_us=xla_us,
        speedup=None if xla_us is None else xla_us / us,
        check=check,
        config=config,
    )


def format_table(rows: list[dict], *, copy_gbs: float, fill_gbs: float) -> str:
    """Markdown table, then the config each kernel row ran with."""
    lines = [
        f"\ncopy bandwidth (read+write): {copy_gbs:.0f} GB/s",
        f"fill bandwidth (write only): {fill_gbs:.0f} GB/s",
        "| kernel | shape | dtype | time us | GB/s | % copy BW | % fill BW | XLA us | speedup "
        "| check |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        xla = "" if r["xla_us"] is None else f"{r['xla_us']:.1f}"
        speed = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        has_gbs = not math.isnan(r["gbs"])
        gbs = f"{r['gbs']:.0f}" if has_gbs else ""
        pct = f"{r['pct']:.0f}%" if has_gbs else ""
        pct_fill = f"{100 * r['gbs'] / fill_gbs:.0f}%" if has_gbs else ""
        lines.append(
            f"| {r['kernel']} | {r['shape']} | {r['dtype']} | {r['us']:.1f} | {gbs} | {pct} "
            f"| {pct_fill} | {xla} | {speed} | {r['check']} |"
        )
    lines += [
        f"  {r['kernel']} {r['shape']} {r['dtype']}: {r['config']}" for r in rows if r["config"]
    ]
    return "\n".join(lines)
