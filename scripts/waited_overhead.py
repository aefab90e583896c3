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

    python scripts/waited_overhead.py [--size 8192] [--samples 20] [--json out.json]
    python scripts/waited_overhead.py --size 64 --samples 2   # CPU smoke run

On an H200 (2026-12-02, BENCHMARKS.md): a jitted bf16 8192^3 matmul 1530.6 us streamed, 1835.7
waited (+305 us); torch's 1592.5 / 1630.9 (+38 us).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

CHAIN_LENGTH = 20  # elementwise passes of the "jax chain" program


def waited_us(call: Callable[[], Any], wait: Callable[[Any], None], samples: int) -> float:
    """Median microseconds of one call waited for (after 3 warm-up calls)."""
    for _ in range(3):
        wait(call())
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        wait(call())
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def streamed_us(
    call: Callable[[], Any], wait: Callable[[Any], None], samples: int, burst: int
) -> float:
    """Median microseconds per call of `burst` back-to-back calls and one wait."""
    for _ in range(2):
        wait(call())
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        result = None
        for _ in range(burst):
            result = None  # let the previous result's buffer be reused
            result = call()
        wait(result)
        times.append((time.perf_counter() - start) * 1e6 / burst)
    return statistics.median(times)


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
    rows = []
    for name, call in programs:
        streamed = streamed_us(call, jax.block_until_ready, samples, burst)
        waited = waited_us(call, jax.block_until_ready, samples)
        rows.append(
            {
                "program": name,
                "streamed_us": streamed,
                "waited_us": waited,
                "overhead_us": waited - streamed,
                "waited_polling_us": waited_us(call, _poll, samples),
            }
        )
    try:
        import torch
    except ImportError:
        return rows
    if not torch.cuda.is_available():
        return rows
    tx = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)

    def sync(_):
        torch.cuda.synchronize()

    streamed = streamed_us(lambda: tx @ tx, sync, samples, burst)
    waited = waited_us(lambda: tx @ tx, sync, samples)
    rows.append(
        {
            "program": f"torch matmul {size}^3 bf16",
            "streamed_us": streamed,
            "waited_us": waited,
            "overhead_us": waited - streamed,
        }
    )
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
