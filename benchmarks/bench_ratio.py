"""Today's code against an earlier commit's, from `bench --json` files of alternating runs.

    python -m benchmarks.bench_ratio --baseline b1.json b2.json --current c1.json c2.json

Each file is one `python -m moe_jax bench ... --json F` run; the baseline and current runs are
taken in alternation on one machine (`bash scripts/gpu_check.sh baseline` does that). For each
shape and variant in both, prints the baseline's and the current code's ms per forward (back to
back) and latency of every run, and current / baseline of each round and of the medians. A
ratio from one machine carries to another card where a figure does not: it says how much of an
issue's "from X ms to Y ms" a change made, on whichever GPU it ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

Key = tuple[str, str]  # (shape, variant)


def load_runs(paths: list[str]) -> list[dict[Key, dict]]:
    """Each file's timed rows by (shape, variant); rows without "ms" (skipped variants) left out.

    A file that is not a `bench --json` result raises ValueError naming it."""
    runs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
        if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
            raise ValueError(f"{path}: not a `bench --json` result (no 'rows' list)")
        runs.append({(row["shape"], row["variant"]): row for row in result["rows"] if "ms" in row})
    return runs


def _ms(rows: list[dict], field: str) -> list[float]:
    return [row[field] for row in rows if row.get(field) is not None]


def compare(baseline: list[dict[Key, dict]], current: list[dict[Key, dict]]) -> list[dict]:
    """One dict per (shape, variant) timed in every run of both lists, in the first current
    run's order: each run's ms and latency_ms, each round's current / baseline ms (runs paired
    in order) and the ratio of the medians."""
    keys = [k for k in current[0] if all(k in run for run in baseline + current)]
    out = []
    for shape, variant in keys:
        base = [run[(shape, variant)] for run in baseline]
        cur = [run[(shape, variant)] for run in current]
        entry = dict(shape=shape, variant=variant)
        for field in ("ms", "latency_ms"):
            b, c = _ms(base, field), _ms(cur, field)
            entry[f"baseline_{field}"], entry[f"current_{field}"] = b, c
            entry[f"{field}_ratio"] = (
                statistics.median(c) / statistics.median(b) if b and c else None
            )
        # runs paired in order; a run of either side beyond the other's count has no pair
        entry["round_ratios"] = [c["ms"] / b["ms"] for b, c in zip(base, cur, strict=False)]
        out.append(entry)
    return out


def _runs(values: list[float]) -> str:
    return " / ".join(f"{v:.3f}" for v in values) or "-"


def table(entries: list[dict]) -> str:
    """The comparison as a Markdown table."""
    lines = [
        "| shape | variant | baseline ms (latency) | current ms (latency) | current / baseline"
        " per round | of medians: ms, latency |",
        "|---|---|---|---|---|---|",
    ]
    for e in entries:
        latency = f"{e['latency_ms_ratio']:.3f}" if e["latency_ms_ratio"] is not None else "-"
        lines.append(
            f"| {e['shape']} | {e['variant']} "
            f"| {_runs(e['baseline_ms'])} ({_runs(e['baseline_latency_ms'])}) "
            f"| {_runs(e['current_ms'])} ({_runs(e['current_latency_ms'])}) "
            f"| {' / '.join(f'{r:.3f}' for r in e['round_ratios'])} "
            f"| {e['ms_ratio']:.3f}, {latency} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", nargs="+", required=True, help="the earlier code's runs")
    parser.add_argument("--current", nargs="+", required=True, help="today's runs")
    args = parser.parse_args(argv)
    try:
        baseline, current = load_runs(args.baseline), load_runs(args.current)
    except (OSError, ValueError, KeyError) as err:
        print(f"bench_ratio: {err}", file=sys.stderr)
        return 2
    entries = compare(baseline, current)
    if not entries:
        print("bench_ratio: no shape and variant was timed in every run", file=sys.stderr)
        return 2
    print(table(entries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
