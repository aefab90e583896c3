"""How much more a call costs when it is waited for than when calls stream, on this host.

A waited call pays the host's dispatch before the first kernel and the wake-up after the last;
a stream of calls hides both behind the device's work. moe_jax's latency figures (`bench`'s
"latency ms") include this cost, so this script measures it for programs that are not
moe_jax's: a jitted matmul, 20 chained elementwise passes (each behind an optimization
barrier, so they stay separate kernels), and, where torch sees a CUDA device, the same matmul in
torch waited for with `torch.cuda.synchronize()`. For JAX it also waits by polling
`Array.is_ready()` instead of `jax.block_until_ready`.

Per program: "streamed us" is the median over `--samples` samples of `--burst` back-to-back
calls and one wait, per call; "waited us" the median of `--samples` single calls each waited
for; "overhead us" their difference.

    python -m benchmarks.waited_overhead [--size 8192] [--samples 20] [--json out.json]
    python -m benchmarks.waited_overhead --size 64 --samples 2   # CPU smoke run

On an H200 (2026-12-02, BENCHMARKS.md): a jitted bf16 8192^3 matmul 1530.6 us streamed, 1835.7
waited (+305 us); torch's 1592.5 / 1630.9 (+38 us).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from moe_jax.cli.timing import time_calls

CHAIN_LENGTH = 20  # elementwise passes of the "jax chain" program


def _row(
    name: str, call: Callable[[], Any], wait: Callable[[Any], None], samples: int, burst: int
) -> dict:
    """streamed, waited and overhead microseconds of `call` (`moe_jax.cli.timing.time_calls`:
    `samples` single waited calls, then `samples` samples of `burst` back-to-back calls)."""
    timing = time_calls(call, wait=wait, samples=samples, burst=burst, latency_samples=samples)
    streamed, waited = timing.streamed_ms * 1e3, timing.latency_ms * 1e3
    return {
        "program": name,
        "streamed_us": streamed,
        "waited_us": waited,
        "overhead_us": waited - streamed,
    }


def _poll(result: jax.Array) -> None:
    while not result.is_ready():
        pass


def _chain(v: jax.Array) -> jax.Array:
    for _ in range(CHAIN_LENGTH):
        v = jax.lax.optimization_barrier(v * 1.0001 + 1.0)
    return v


def measure(size: int, samples: int, burst: int) -> list[dict]:
    """One row per program (see the module docstring)."""
    x = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    v = jnp.ones((size * size,), jnp.float32)
    matmul, chain = jax.jit(lambda a: a @ a), jax.jit(_chain)
    programs = [
        (f"jax matmul {size}^3 bf16", lambda: matmul(x)),
        (f"jax chain of {CHAIN_LENGTH} elementwise passes", lambda: chain(v)),
    ]
    rows = [_row(name, call, jax.block_until_ready, samples, burst) for name, call in programs]
    for row, (_, call) in zip(rows, programs, strict=True):
        polled = time_calls(call, wait=_poll, samples=1, latency_samples=samples)
        row["waited_polling_us"] = polled.latency_ms * 1e3
    try:
        import torch
    except ImportError:
        return rows
    if not torch.cuda.is_available():
        return rows
    tx = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)

    def sync(_):
        torch.cuda.synchronize()

    rows.append(_row(f"torch matmul {size}^3 bf16", lambda: tx @ tx, sync, samples, burst))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192, help="matmul side; chain of size^2")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--burst", type=int, default=10)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.size < 1 or args.samples < 1 or args.burst < 1:
        parser.error(f"{args.size=}, {args.samples=}, {args.burst=}: each must be >= 1")
    rows = measure(args.size, args.samples, args.burst)
    print(f"jax={jax.__version__} backend={jax.default_backend()} device={jax.devices()[0]}")
    print("| program | streamed us | waited us | overhead us | waited, polling us |")
    print("|---|---|---|---|---|")
    for row in rows:
        polling = row.get("waited_polling_us")
        print(
            f"| {row['program']} | {row['streamed_us']:.1f} | {row['waited_us']:.1f} | "
            f"{row['overhead_us']:+.1f} | {'' if polling is None else f'{polling:.1f}'} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
