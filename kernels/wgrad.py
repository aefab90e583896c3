"""Pallas GPU grouped weight gradient: the `WGRADS` implementation "pallas".

dw[e] = dy_e^T x_e over expert e's rows of the contiguous layout, [E, N, K], accumulated in
float32 and written straight into the output XLA allocated (the torch wgrad returns a new tensor
that the bridge must copy). The segment of expert e is rows [ends[e-1], ends[e]) (ends[-1] = 0),
a multiple of the layout's alignment, so it splits into whole `block_m`-row steps; padding rows
inside a segment are zero, as `grouped_wgrad` guarantees. One program owns one
[block_n, block_k] tile of one expert's dw:

    grid = (K / block_k, N / block_n, E)        fastest first: programs of one expert and one
                                                 dy column tile run together and share it in L2
    acc[block_n, block_k] = 0 (float32)
    for r in range(start_e, end_e, block_m):     a dynamic trip count: the segment's length
        acc += dy[r:r+block_m, n-tile]^T @ x[r:r+block_m, k-tile]
    dw[e, n-tile, k-tile] = acc                  empty experts get zeros

Worked example, block_m 16, ends = [32, 32, 80]: expert 0 sums rows 0-31 in two steps, expert 1
has no rows (its tiles are written as zeros), expert 2 sums rows 32-79 in three steps.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from moe_jax import grouped_gemm, grouped_gemm_backward
from moe_jax.kernels import _triton
from moe_jax.routing import require_int

MIN_BLOCK = 16  # smallest tile side Triton's dot takes
_DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WgradConfig:
    """Tiles of the wgrad kernel: powers of two >= 16 (block_m must divide the alignment);
    defaults measured in BENCHMARKS.md, Thresholds: `WgradConfig`.

    Attributes:
      block_m: rows (tokens) summed per loop step.
      block_n: dw rows (dy columns) per program.
      block_k: dw columns (x columns) per program.
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining stages of the row loop.
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 256
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"WgradConfig.{name}={value} but a power of two is needed")
        for name in ("block_m", "block_n", "block_k"):
            if getattr(self, name) < MIN_BLOCK:
                raise ValueError(f"WgradConfig.{name}={getattr(self, name)} but >= 16 is needed")
        if self.num_stages < 1:
            raise ValueError(f"WgradConfig.num_stages={self.num_stages} but >= 1 is needed")


def fitted_config(config: WgradConfig, *, n: int, k: int, alignment: int) -> WgradConfig:
    """`config` with each tile side cut to the largest power of two dividing its dimension."""
    return dataclasses.replace(
        config,
        block_m=_triton.largest_power_of_2_divisor(alignment, config.block_m),
        block_n=_triton.largest_power_of_2_divisor(n, config.block_n),
        block_k=_triton.largest_power_of_2_divisor(k, config.block_k),
    )


def unsupported_reason(problem: grouped_gemm.GemmProblem) -> str | None:
    """Why the kernel cannot run `problem` (dw [E, N, K] from dy [M, N] and x [M, K]), or None."""
    if problem.layout != "contiguous":
        return f"layout {problem.layout!r}: the grouped wgrad runs on the contiguous layout"
    if problem.x_dtype not in _DTYPES or problem.x_dtype != problem.w_dtype:
        return f"dy and x of one dtype of {_DTYPES}, got {problem.x_dtype}, {problem.w_dtype}"
    alignment = problem.alignment or 0
    for name, value in (("N", problem.n), ("K", problem.k), ("alignment", alignment)):
        if value % MIN_BLOCK:
            return f"{name}={value} must be a multiple of {MIN_BLOCK} (Triton's smallest dot tile)"
    return None


def _wgrad_kernel(ends_ref, dy_ref, x_ref, out_ref, *, block_m: int, block_n: int, block_k: int):
    """One [block_n, block_k] tile of dw[e] (see the module docstring)."""
    k0 = pl.program_id(0) * block_k
    n0 = pl.program_id(1) * block_n
    expert = pl.program_id(2)
    end = ends_ref[expert]
    start = jnp.where(expert > 0, ends_ref[jnp.maximum(expert - 1, 0)], 0)
    num_steps = jnp.maximum(end - start, 0) // block_m

    def step(i, acc):
        row = pl.multiple_of(start + i * block_m, MIN_BLOCK)
        dy = dy_ref[pl.ds(row, block_m), pl.ds(n0, block_n)]
        x = x_ref[pl.ds(row, block_m), pl.ds(k0, block_k)]
        return acc + jnp.dot(dy.T, x, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, num_steps, step, jnp.zeros((block_n, block_k), jnp.float32))
    out_ref[expert, pl.ds(n0, block_n), pl.ds(k0, block_k)] = acc.astype(out_ref.dtype)


def grouped_wgrad(
    dy: jax.Array,
    x: jax.Array,
    expert_ids: jax.Array,
    expert_ends: jax.Array,
    *,
    num_experts: int,
    alignment: int,
    out_dtype: jnp.dtype,
    config: WgradConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Grouped weight gradient dw [E, N, K] = dy_e^T x_e over each expert's segment.

    Args:
      dy: [M, N] output cotangents on the contiguous layout; padding rows zero.
      x: [M, K] the GEMM's inputs on the same layout, dy's dtype; padding rows zero.
      expert_ids: int32[M] (unused: the segments come from `expert_ends`).
      expert_ends: int32[E] segment ends; segment lengths are multiples of `alignment`.
      num_experts: E.
      alignment: the layout's segment multiple (a multiple of 16).
      out_dtype: dtype of dw.
      config: tiles (cut to the problem by `fitted_config`); None takes `WgradConfig()`.
      interpret: run the kernel in Pallas interpret mode (CPU tests).

    Returns:
      [E, N, K] in `out_dtype`; experts with no rows get zeros.

    Example:
      >>> dy = jnp.ones((32, 16)); x = jnp.ones((32, 16))
      >>> ends = jnp.array([16, 16, 32], jnp.int32)
      >>> dw = grouped_wgrad(dy, x, None, ends, num_experts=3, alignment=16,
      ...                    out_dtype=jnp.float32, interpret=True)
      >>> dw[:, 0, 0].tolist()
      [16.0, 0.0, 16.0]
    """
    del expert_ids
    if dy.ndim != 2 or x.ndim != 2:
        raise ValueError(f"{dy.shape=} {x.shape=}: need dy [M, N] and x [M, K]")
    num_rows, n = dy.shape
    k = x.shape[1]
    if x.shape[0] != num_rows or expert_ends.shape != (num_experts,):
        raise ValueError(
            f"{dy.shape=} {x.shape=} {expert_ends.shape=}: need dy [M, N], x [M, K] and "
            f"expert_ends [{num_experts}]"
        )
    if dy.dtype != x.dtype or jnp.dtype(dy.dtype).name not in _DTYPES:
        raise TypeError(f"{dy.dtype=} {x.dtype=}: need one dtype of {_DTYPES}")
    if require_int("alignment", alignment) < 1:
        raise ValueError(f"{alignment=} but a positive multiple of {MIN_BLOCK} is needed")
    for name, value in (("N", n), ("K", k), ("alignment", alignment)):
        if value % MIN_BLOCK:
            raise ValueError(f"{name}={value}: the wgrad kernel needs multiples of {MIN_BLOCK}")
    config = fitted_config(config or WgradConfig(), n=n, k=k, alignment=alignment)
    if num_experts == 0 or num_rows == 0 or n == 0 or k == 0:  # no tile: K = 0 sums nothing
        return jnp.zeros((num_experts, n, k), out_dtype)
    kernel = functools.partial(
        _wgrad_kernel, block_m=config.block_m, block_n=config.block_n, block_k=config.block_k
    )
    with _triton.quiet_triton_deprecation():
        return pl.pallas_call(
            kernel,
            grid=(k // config.block_k, n // config.block_n, num_experts),
            out_shape=jax.ShapeDtypeStruct((num_experts, n, k), out_dtype),
            interpret=interpret,
            compiler_params=_triton.compiler_params(
                num_warps=config.num_warps, num_stages=config.num_stages
            ),
            name=f"grouped_wgrad_{config.block_m=}_{config.block_n=}_{config.block_k=}"
            f"_{config.num_warps=}_{config.num_stages=}",
        )(expert_ends.astype(jnp.int32), dy, x)


_triton.register_pallas(
    grouped_gemm_backward.WGRADS, grouped_wgrad, compiled_refusal=unsupported_reason
)
