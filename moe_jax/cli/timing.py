"""Timing and error measures shared by `python -m moe_jax demo` and `python -m moe_jax bench`."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

BURST = 10  # back-to-back calls per streamed sample


def time_jax(fn: Callable, args: tuple, *, iters: int) -> tuple[float, float]:
    """(streamed ms, latency ms) of `fn(*args)` after two warm-up calls.

    streamed: median over samples of BURST back-to-back calls, one `block_until_ready` at the end
    of each sample, divided by BURST: the per-forward cost when the host runs ahead, as in a model
    with many layers. latency: median of single calls each waited for (dispatch and host work of
    the torch callbacks included).
    """
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    latencies = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        latencies.append((time.perf_counter() - start) * 1e3)
    streamed = []
    for _ in range(max(3, iters // 2)):
        start = time.perf_counter()
        for _ in range(BURST):
            out = fn(*args)
        jax.block_until_ready(out)
        del out
        streamed.append((time.perf_counter() - start) * 1e3 / BURST)
    return statistics.median(streamed), statistics.median(latencies)


def rel_error(out: jax.Array, ref: jax.Array) -> float:
    """||out - ref|| / ||ref|| (Frobenius), computed in float32."""
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
