"""`python -m moe_jax info`: what this machine offers moe_jax, and why a backend would not run.

`info --plan --tokens T --hidden H --intermediate I --experts E --topk k [--fp8] [--platform gpu]`
prints the plan (`moe_jax.plan`) that `fused_moe(experts="auto")` runs for one such call, each
stage with its reason and the candidates it skipped; with `--fp8` also the plan it runs under
`jax.grad` (the FP8 weights held constant, the GEMMs quantizing float tokens). `--platform`
plans for another platform than this machine's (a GPU's plan on a CPU); backends that need a
library, a GPU of a given compute capability or a jax version are then judged by this machine's
installation, and say so.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import sys

import jax

from moe_jax import grouped_gemm
from moe_jax.registry import NoImplementationError

_PLAN_SIZES = ("tokens", "hidden", "intermediate", "experts", "topk")

# A DeepSeek-V3-sized slice (shape A of the benchmarks) asks every backend the same question.
_PROBLEM = dict(num_tokens=4096, topk=8, num_experts=32, hidden=7168, intermediate=2048)


def _version(module: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as error:  # a broken install is worth reporting, not raising
        return f"fails to import: {type(error).__name__}: {error}"


def report() -> str:
    """Versions, devices, and for each GEMM backend and dtype: 'runs' or the backend's reason."""
    p = _PROBLEM
    lines = [
        f"jax {jax.__version__}, default backend {jax.default_backend()}, "
        f"devices: {', '.join(d.device_kind for d in jax.devices())}",
        f"torch: {_version('torch')}; deep_gemm: {_version('deep_gemm')}; "
        f"deep_ep: {_version('deep_ep')}",
        "",
        f"grouped-GEMM backends for GEMM1 of T={p['num_tokens']} k={p['topk']} "
        f"E={p['num_experts']} H={p['hidden']} I={p['intermediate']} "
        "(experts='auto' takes the first that runs of those it prefers here, listed first):",
    ]
    for dtype in ("float8_e4m3fn", "bfloat16"):
        problem = grouped_gemm.GemmProblem(
            layout="contiguous",
            n=2 * p["intermediate"],
            k=p["hidden"],
            num_experts=p["num_experts"],
            num_pairs=p["num_tokens"] * p["topk"],
            x_dtype=dtype,
            w_dtype=dtype,
            alignment=128,
            platform=jax.default_backend(),
        )
        lines.append(f"  {dtype}:")
        order = grouped_gemm.GEMMS.preference(problem)
        reasons = grouped_gemm.GEMMS.reasons(problem)
        listed = [*order, *(name for name in reasons if name not in order)]
        width = max(map(len, listed))
        for name in listed:
            why = reasons[name]
            lines.append(f"    {name:<{width}} {'runs' if why is None else 'no: ' + why}")
    return "\n".join(lines)


def plan_report(
    *,
    tokens: int,
    hidden: int,
    intermediate: int,
    experts: int,
    topk: int,
    is_fp8: bool,
    platform: str | None = None,
) -> str:
    """The plan of `experts="auto"` for one call of these sizes (bf16 tokens; FP8 block weights
    with `is_fp8`, which quantizes the tokens in groups of 128, and then also the plan under
    differentiation), as text."""
    from moe_jax.contiguous_experts import ContiguousExperts
    from moe_jax.experts import ExpertsProblem

    here = jax.default_backend()
    platform = platform or here
    dtype = "float8_e4m3fn" if is_fp8 else "bfloat16"
    weights = experts * 3 * hidden * intermediate * (1 if is_fp8 else 2)
    problem = ExpertsProblem(
        num_tokens=tokens,
        topk=topk,
        num_experts=experts,
        hidden=hidden,
        intermediate=intermediate,
        x_dtype=dtype,
        mid_dtype="bfloat16",
        group_size=128 if is_fp8 else None,
        weight_bytes=weights,
        w_dtype=dtype,
        platform=platform,
    )
    lines = [f"fused_moe(experts='auto'), jax {jax.__version__}:"]
    if platform != here:
        lines.append(
            f"(planned for {platform} on a {here} machine: a backend's library, GPU compute "
            "capability and jax version are this machine's; see each refusal)"
        )
    lines.append(ContiguousExperts().plan(problem).describe())
    if is_fp8:
        lines.append("under jax.grad (FP8 weights held constant, bf16 tokens):")
        frozen = dataclasses.replace(problem, x_dtype="bfloat16")
        lines.append(ContiguousExperts().plan(frozen).describe())
    return "\n".join(lines)


def run_info(args: argparse.Namespace) -> int:
    """`info` (versions and backends) or `info --plan` (one call's plan); 2 on bad arguments."""
    sizes = {name: getattr(args, name) for name in _PLAN_SIZES}
    if not args.plan:
        given = [f"--{name}" for name, value in sizes.items() if value is not None]
        if given or args.fp8 or args.platform:
            print(f"{' '.join(given) or '--fp8/--platform'}: for --plan only", file=sys.stderr)
            return 2
        print(report())
        return 0
    missing = [f"--{name}" for name, value in sizes.items() if value is None]
    bad = [f"--{name} {value}" for name, value in sizes.items() if value is not None and value < 1]
    if missing or bad:
        why = f"needs {' '.join(missing)}" if missing else f"{', '.join(bad)}: at least 1"
        print(f"info --plan {why}", file=sys.stderr)
        return 2
    try:
        print(plan_report(**sizes, is_fp8=args.fp8, platform=args.platform))
    except NoImplementationError as error:
        print(f"no plan runs this call: {error}", file=sys.stderr)
        return 2
    return 0
