"""Command line: `python -m moe_jax demo | bench | info` (also `moe-jax ...` once installed).

The commands live in `moe_jax.cli`, imported only for the command that runs. `bench` times the
layer's forward; `bench --decode` decode-size batches; `bench --train` a training step (forward +
backward) against a torchtitan-style torch step; `--json` and `--plot` write the results. The
profiling tools (each stage's time, kernel traces, kernel sweeps) are not part of the package:
from a checkout, `python -m benchmarks.NAME` (benchmarks/__init__.py lists them).
"""

from __future__ import annotations

import argparse
import os
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moe_jax", description=__doc__.splitlines()[0])
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
    bench.add_argument(
        "--shapes",
        nargs="+",
        help="A, B, small (default: A B on GPU, else small; with --train: B on GPU, else small)",
    )
    bench.add_argument(
        "--variants",
        nargs="+",
        help="subset of variants (default: all; --train and --decode have their own: with "
        "--decode, fused_moe experts names such as auto deep_gemm pallas deep_gemm_masked, the "
        "same on bf16 weights as auto_bf16, and the tokamax peers tokamax tokamax_mosaic "
        "tokamax_triton)",
    )
    bench.add_argument("--iters", type=int, default=20, help="timed calls per variant (median)")
    bench.add_argument(
        "--decode", action="store_true", help="time decode-size batches instead (--tokens)"
    )
    bench.add_argument(
        "--tokens", type=int, nargs="+", help="token counts for --decode (default: its own list)"
    )
    bench.add_argument(
        "--train",
        action="store_true",
        help="time a training step (forward + backward) against torchtitan's torch step instead",
    )
    bench.add_argument(
        "--model",
        action="store_true",
        help="time training steps of a whole Qwen3-MoE model against jax.lax.ragged_dot and "
        "transformers instead (--shapes: qwen3-2b on GPU, else tiny)",
    )
    bench.add_argument("--json", help="also write the results to this JSON file")
    bench.add_argument(
        "--plot", help="also write a PNG bar chart of the times (needs matplotlib: .[notebooks])"
    )
    info = commands.add_parser(
        "info",
        help="versions, devices, and which GEMM backends run here (or why not); with --plan, "
        "what one experts call runs and why",
    )
    info.add_argument("--plan", action="store_true", help="print the plan of one experts call")
    for flag, size in (("tokens", "T"), ("hidden", "H"), ("intermediate", "I")):
        info.add_argument(f"--{flag}", type=int, help=f"{size} for --plan")
    info.add_argument("--experts", type=int, help="E for --plan")
    info.add_argument("--topk", type=int, help="k for --plan")
    info.add_argument("--fp8", action="store_true", help="FP8 block weights (default: bf16)")
    info.add_argument(
        "--platform", choices=("cpu", "gpu"), help="plan for this platform (default: this one's)"
    )
    return parser


def _refuse(message: str) -> int:
    print(message, file=sys.stderr)
    return 2


def _output_problem(args: argparse.Namespace) -> str | None:
    """Why --json or --plot cannot be written, checked before a run that may take minutes."""
    for flag in ("json", "plot"):
        path = getattr(args, flag)
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            return f"--{flag} {path}: the folder {folder} does not exist; create it first"
    if args.plot is not None:
        from moe_jax.cli.layer_report import missing_plot_dependency

        return missing_plot_dependency()
    return None


def _bench(args: argparse.Namespace) -> int:
    if args.decode and args.train:
        return _refuse("--decode and --train are separate benchmarks: run one at a time")
    if args.iters < 1:
        return _refuse(f"--iters {args.iters}: at least 1 timed call per variant is needed")
    if (problem := _output_problem(args)) is not None:
        return _refuse(problem)
    if args.model:
        if args.decode or args.train or args.tokens is not None:
            return _refuse("--model is its own benchmark: drop --decode, --train and --tokens")
        from moe_jax.cli.model_bench import run_model_bench

        return run_model_bench(
            shapes=args.shapes,
            variants=args.variants,
            iters=args.iters,
            json_path=args.json,
            plot_path=args.plot,
        )
    if args.train:
        if args.tokens is not None:
            return _refuse("--tokens applies to bench --decode only")
        from moe_jax.cli.train_bench import run_train_bench

        return run_train_bench(
            shapes=args.shapes,
            variants=args.variants,
            iters=args.iters,
            json_path=args.json,
            plot_path=args.plot,
        )
    if args.decode:
        if args.shapes:
            return _refuse("--shapes does not apply to --decode: it sets T with --tokens")
        from moe_jax.cli.decode_bench import run_decode_bench

        return run_decode_bench(
            tokens=args.tokens,
            iters=args.iters,
            json_path=args.json,
            plot_path=args.plot,
            variants=args.variants,
        )
    if args.tokens is not None:
        return _refuse("--tokens applies to bench --decode only")
    from moe_jax.cli.layer_bench import run_layer_bench

    return run_layer_bench(
        shapes=args.shapes,
        variants=args.variants,
        iters=args.iters,
        json_path=args.json,
        plot_path=args.plot,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "info":
        from moe_jax.cli.info import run_info

        return run_info(args)
    if args.command == "bench":
        return _bench(args)
    if args.tokens < 1:
        return _refuse(f"--tokens {args.tokens}: the demo needs at least 1 token")
    from moe_jax.experts_by_name import resolve_experts

    try:
        resolve_experts(args.experts)
    except ValueError as e:
        return _refuse(f"--experts {args.experts}: {e}")
    from moe_jax.cli.demo import run_demo_command

    return run_demo_command(tokens=args.tokens, experts=args.experts)


if __name__ == "__main__":
    sys.exit(main())
