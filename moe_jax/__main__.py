"""Command line: `python -m moe_jax demo | bench | info` (also `moe-jax ...` once installed)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_jax", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run a small DeepSeek-style FP8 MoE layer and check it")
    demo.add_argument(
        "--experts",
        default="auto",
        help="experts backend: auto, xla, torch, deep_gemm, ... (default: auto)",
    )
    demo.add_argument("--tokens", type=int, default=256, help="number of tokens T (default 256)")
    bench = commands.add_parser(
        "bench", help="time the whole layer against baselines (shapes A and B on a GPU)"
    )
    bench.add_argument("--shapes", nargs="+", help="A, B, small (default: A B on GPU, else small)")
    bench.add_argument("--variants", nargs="+", help="subset of variants (default: all)")
    bench.add_argument("--iters", type=int, default=20, help="timed calls per variant (median)")
    bench.add_argument(
        "--breakdown", action="store_true", help="also time each stage of the FP8 forward"
    )
    bench.add_argument("--json", help="also write the results to this JSON file")
    bench.add_argument("--plot", help="also write a PNG bar chart of the times")
    commands.add_parser(
        "info", help="versions, devices, and which GEMM backends run here (or why not)"
    )
    args = parser.parse_args(argv)

    if args.command == "info":
        from moe_jax.info import report

        print(report())
        return 0

    if args.command == "bench":
        from moe_jax import bench as bench_module

        return bench_module.main(args)

    if args.command == "demo":
        from moe_jax.demo import DemoShape, format_table, run_demo

        shape = DemoShape(num_tokens=args.tokens)
        rows = run_demo(shape, experts=args.experts)
        print(format_table(shape, rows))
        worst = max(r["rel_err"] for r in rows)
        if not worst < 0.1:
            print(f"FAILED: relative error {worst:.3g} is above 0.1", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
