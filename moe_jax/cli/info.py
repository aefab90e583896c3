"""`python -m moe_jax info`: what this machine offers moe_jax, and why a backend would not run."""

from __future__ import annotations

import importlib
import importlib.util

import jax

from moe_jax import grouped_gemm

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
