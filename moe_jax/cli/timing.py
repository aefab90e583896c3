"""The one timing loop of the CLI and benchmarks, and the error measure they report.

Every benchmark times through `time_calls` (JAX functions through `time_jax`, torch code through
`time_torch`), so every number in every table means the same thing: wall-clock time on the host
(`time.perf_counter`) around calls that are waited for, after two warm-up calls.

- streamed: median over samples of `burst` back-to-back calls, waited for once at the end of the
  sample, divided by `burst`: the per-call cost when the host runs ahead, as in a model with many
  layers.
- latency: median of single calls, each waited for (dispatch and host work included).

Before each call the previous result is dropped, so a call can reuse the buffer of the last one
(as a torch program writing into the same `out` does).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

BURST = 10  # back-to-back calls per streamed sample
WARMUP = 2  # calls before timing: compilation, autotuning, DeepGEMM's JIT


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timing:
    """Medians in milliseconds per call; `latency_ms` is None when not measured;
    `streamed_samples_ms` holds each streamed sample (ms per call, in the order timed)."""

    streamed_ms: float
    latency_ms: float | None
    streamed_samples_ms: tuple[float, ...] = ()


def time_calls(
    call: Callable[[], Any],
    *,
    wait: Callable[[Any], None],
    samples: int,
    burst: int = BURST,
    latency_samples: int = 0,
) -> Timing:
    """Times `call()` (see the module docstring).

    Args:
      call: runs the work once and returns its result (an array, a pytree, a tensor or None).
      wait: blocks until a result of `call` is computed (`jax.block_until_ready`, or a CUDA
        synchronize for torch).
      samples: streamed samples (at least 1).
      burst: back-to-back calls per streamed sample (at least 1).
      latency_samples: single waited-for calls to time; 0 skips the latency measure.
    """
    if samples < 1 or burst < 1 or latency_samples < 0:
        raise ValueError(
            f"{samples=}, {burst=}, {latency_samples=}: samples and burst must be >= 1, "
            "latency_samples >= 0"
        )
    for _ in range(WARMUP):
        wait(call())
    latencies = []
    for _ in range(latency_samples):
        start = time.perf_counter()
        wait(call())
        latencies.append((time.perf_counter() - start) * 1e3)
    streamed = []
    for _ in range(samples):
        out = None
        start = time.perf_counter()
        for _ in range(burst):
            out = None  # drop the last result first, so its buffer can be reused
            out = call()
        wait(out)
        streamed.append((time.perf_counter() - start) * 1e3 / burst)
        del out
    return Timing(
        streamed_ms=statistics.median(streamed),
        latency_ms=statistics.median(latencies) if latencies else None,
        streamed_samples_ms=tuple(streamed),
    )


def time_jax(fn: Callable, args: tuple, *, iters: int) -> tuple[float, float]:
    """(streamed ms, latency ms) of `fn(*args)`: `iters` latency samples and max(3, iters // 2)
    streamed samples of `BURST` calls."""
    timing = time_calls(
        lambda: fn(*args),
        wait=jax.block_until_ready,
        samples=max(3, iters // 2),
        latency_samples=iters,
    )
    return timing.streamed_ms, timing.latency_ms


def time_torch(fn: Callable[[], Any], *, iters: int) -> tuple[float, float]:
    """(streamed ms, latency ms) of a torch CUDA function, as `time_jax` times a JAX one: the
    wait is `torch.cuda.synchronize()`."""
    import torch

    timing = time_calls(
        fn,
        wait=lambda _: torch.cuda.synchronize(),
        samples=max(3, iters // 2),
        latency_samples=iters,
    )
    return timing.streamed_ms, timing.latency_ms


def rel_error(out: jax.Array, ref: jax.Array) -> float:
    """||out - ref|| / ||ref|| (Frobenius), computed in float32."""
    out, ref = jnp.asarray(out).astype(jnp.float32), jnp.asarray(ref).astype(jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
