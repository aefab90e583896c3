"""Pallas GPU row gather of the permute: rows of the contiguous layout copied from their tokens.

`moe_jax.permute.permute` routes first (which token feeds each output row: the layout's
`sources`) and calls `gather_rows`, the `PERMUTES` implementation "pallas". One program per
block of output rows and hidden columns reads the source token of each row and copies it,
writing zeros on padding rows (or, with `is_padding_zeroed=False`, nothing there). Every output
element is written at most once, with no atomics, so interpret mode (CPU tests) runs the same
program.

Worked example, alignment 4, E=2, topk_ids = [[1, 0], [1, 1]] (`moe_jax.layouts`' example):

    sources = [0, -1, -1, -1, 0, 1, 1, -1, -1, -1, -1, -1]
    out     = [x0, 0, 0, 0, x0, x1, x1, 0, 0, 0, 0, 0]
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from moe_jax.kernels import _triton

# Copies move bits: each row dtype travels as the unsigned integer of its width.
_BITS_DTYPE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PermuteConfig:
    """Tunables of the row-gather kernel.

    Attributes:
      block_m: output rows per program (power of two).
      block_h: hidden columns per program (power of two); a tail past H is masked.
      num_warps: Triton warps per program.
      num_stages: Triton pipeline stages (the kernel has no loop; 1 is enough).
      has_eviction_hints: keep token rows in L2 (each is read k times) and stream the output
        rows past it (written once); False issues plain loads and stores.
    """

    block_m: int = 16
    block_h: int = 1024
    num_warps: int = 4
    num_stages: int = 1
    has_eviction_hints: bool = True

    def __post_init__(self):
        for name in ("block_m", "block_h", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"PermuteConfig.{name}={value} but a power of two is needed")
        if self.num_stages < 1:
            raise ValueError(f"PermuteConfig.num_stages={self.num_stages} but >= 1 is needed")


def heuristic_config(num_rows: int, hidden: int, itemsize: int) -> PermuteConfig:
    """Block sizes for copying `num_rows` rows of `hidden` elements of `itemsize` bytes.

    About 2 KiB of each row per program and 16 rows, so a program moves ~32 KiB; row blocks shrink
    for tiny problems; 8 warps for 2-byte rows, 4 for FP8 (BENCHMARKS.md, Thresholds: "PERMUTES,
    UNPERMUTES `pallas_then_xla`").
    """
    block_h = _triton.hidden_block(hidden, cap=max(64, 2048 // itemsize))
    block_m = min(16, _triton.next_power_of_2(num_rows))
    num_warps = 8 if itemsize >= 2 else 4
    return PermuteConfig(block_m=block_m, block_h=block_h, num_warps=num_warps, num_stages=1)


def _gather_rows_kernel(
    # inputs
    source_ref,
    x_ref,
    scales_ref,
    # outputs
    out_ref,
    out_scales_ref,
    *,
    block_m: int,
    block_h: int,
    block_g: int,
    num_rows: int,
    num_tokens: int,
    hidden: int,
    num_groups: int,
    has_eviction_hints: bool,
    is_scales_group_major: bool,
    is_padding_zeroed: bool,
):
    """out[r, h] = x[source[r], h] where source[r] >= 0, else 0, for one [block_m, block_h] tile.

    The programs of the first column block also copy the rows' scales ([block_m, block_g]),
    into out_scales[r, g], or out_scales[g, r] with `is_scales_group_major`. Without
    `is_padding_zeroed` rows with source[r] < 0 are not written at all (rows and scales).
    """
    rows = pl.program_id(0) * block_m + jnp.arange(block_m, dtype=jnp.int32)
    cols = pl.program_id(1) * block_h + jnp.arange(block_h, dtype=jnp.int32)
    row_ok = rows < num_rows
    col_ok = cols < hidden
    source = plt.load(source_ref.at[jnp.where(row_ok, rows, 0)], mask=row_ok, other=-1)
    has_source = source >= 0
    # Clamped indices keep masked lanes in bounds; the mask decides what is read.
    token = jnp.clip(source, 0, num_tokens - 1)
    row_written = row_ok if is_padding_zeroed else row_ok & has_source
    taken = plt.load(
        x_ref.at[token[:, None], cols[None, :]],
        mask=has_source[:, None] & col_ok[None, :],
        other=0,
        eviction_policy="evict_last" if has_eviction_hints else None,
    )
    plt.store(
        out_ref.at[rows[:, None], cols[None, :]],
        taken,
        mask=row_written[:, None] & col_ok[None, :],
        eviction_policy="evict_first" if has_eviction_hints else None,
    )
    if scales_ref is None:
        return

    @pl.when(pl.program_id(1) == 0)
    def _copy_scales():
        groups = jnp.arange(block_g, dtype=jnp.int32)
        group_ok = groups < num_groups
        scales = plt.load(
            scales_ref.at[token[:, None], groups[None, :]],
            mask=has_source[:, None] & group_ok[None, :],
            other=0,
        )
        at = (
            (groups[None, :], rows[:, None])
            if is_scales_group_major
            else (rows[:, None], groups[None, :])
        )
        plt.store(
            out_scales_ref.at[at],
            scales,
            mask=row_written[:, None] & group_ok[None, :],
        )


def _gather_rows_no_scales_kernel(source_ref, x_ref, out_ref, **kwargs):
    _gather_rows_kernel(source_ref, x_ref, None, out_ref, None, **kwargs)


@functools.partial(
    jax.jit, static_argnames=("config", "is_scales_group_major", "is_padding_zeroed", "interpret")
)
def gather_rows(
    x: jax.Array,
    x_scales: jax.Array | None,
    sources: jax.Array,
    *,
    config: PermuteConfig | None = None,
    is_scales_group_major: bool = False,
    is_padding_zeroed: bool = True,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """(x[sources[r]], x_scales[sources[r]]), zero where sources[r] < 0 (left unwritten without
    `is_padding_zeroed`); bit-exact copies (`moe_jax.layouts.gather_rows`).

    The front (`moe_jax.permute.permute`) checks the arguments and answers empty axes itself.

    Args:
      x: [T, H] rows of any 1-, 2- or 4-byte dtype; H >= 1.
      x_scales: float32[T, G] (G >= 1) or None.
      sources: int32[M] token of each output row (M >= 1), -1 for padding.
      config: block sizes; None picks `heuristic_config(M, H, itemsize)`.
      is_scales_group_major, is_padding_zeroed: as for `moe_jax.permute.permute` (scales
        written [G, M] in memory and returned as their transpose; padding rows left unwritten).
      interpret: run the Pallas kernel in interpret mode (CPU tests).

    Returns:
      (rows [M, H] in x's dtype, row_scales float32[M, G] or None).

    Example:
      >>> rows, _ = gather_rows(jnp.array([[1.0], [2.0]]), None, jnp.array([1, -1, 0]),
      ...                       interpret=True)
      >>> rows.tolist()
      [[2.0], [0.0], [1.0]]
    """
    num_tokens, hidden = x.shape
    num_rows = sources.shape[0]
    if config is None:
        config = heuristic_config(num_rows, hidden, x.dtype.itemsize)
    block_h = min(config.block_h, _triton.next_power_of_2(hidden))
    num_groups = 0 if x_scales is None else x_scales.shape[1]
    kernel = functools.partial(
        _gather_rows_kernel if x_scales is not None else _gather_rows_no_scales_kernel,
        block_m=config.block_m,
        block_h=block_h,
        block_g=_triton.next_power_of_2(num_groups),
        num_rows=num_rows,
        num_tokens=num_tokens,
        hidden=hidden,
        num_groups=num_groups,
        has_eviction_hints=config.has_eviction_hints,
        is_scales_group_major=is_scales_group_major,
        is_padding_zeroed=is_padding_zeroed,
    )
    operands = [x] if x_scales is None else [x, x_scales]
    bits = [jax.lax.bitcast_convert_type(a, _BITS_DTYPE[a.dtype.itemsize]) for a in operands]
    out_shape = [jax.ShapeDtypeStruct((num_rows, hidden), bits[0].dtype)]
    if x_scales is not None:
        scales_shape = (num_groups, num_rows) if is_scales_group_major else (num_rows, num_groups)
        out_shape.append(jax.ShapeDtypeStruct(scales_shape, bits[1].dtype))
    with _triton.quiet_triton_deprecation():
        out = pl.pallas_call(
            kernel,
            grid=(pl.cdiv(num_rows, config.block_m), pl.cdiv(hidden, block_h)),
            out_shape=out_shape,
            interpret=interpret,
            compiler_params=_triton.compiler_params(
                num_warps=config.num_warps, num_stages=config.num_stages
            ),
            name=f"permute_{config.block_m=}_{block_h=}_{config.num_warps=}"
            f"_{config.has_eviction_hints=}",
        )(sources, *bits)
    out = [jax.lax.bitcast_convert_type(o, a.dtype) for o, a in zip(out, operands, strict=True)]
    if x_scales is None:
        return out[0], None
    return out[0], out[1].T if is_scales_group_major else out[1]
