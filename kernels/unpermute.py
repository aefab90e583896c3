"""Pallas GPU unpermute: weight-and-reduce from expert rows back to tokens, in gather form.

out[t] = cast(sum over slots j = 0..k-1 with inverse[t, j] >= 0 of fp32(y[inverse[t, j]]) * w[t, j])

One program owns a [block_t, block_h] tile of the output: it reads its tokens' k row indices
through `inverse`, gathers those rows' columns, and accumulates in float32 in slot order. Each
output element is written exactly once, so the kernel needs no atomics and no zero-fill, any
hidden size works (the column tail past H is masked), and interpret mode runs the same program.

Worked example, k=2, inverse = [[4, 0], [-1, 6]], w = [[0.5, 2.0], [1.0, -1.0]]:

    out[0] = 0.5 * y[4] + 2.0 * y[0]        out[1] = -1.0 * y[6]   (slot 0 routed nowhere)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from moe_jax.kernels import _triton


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnpermuteConfig:
    """Tunables of the gather-reduce kernel.

    Attributes:
      block_t: tokens per program (power of two).
      block_h: hidden columns per program (power of two); a tail past H is masked.
      num_warps: Triton warps per program.
      num_stages: Triton pipeline stages (the slot loop is unrolled; 1 is enough).
      has_eviction_hints: stream the gathered rows and the output past L2 (each byte is touched
        once); False issues plain loads and stores.
    """

    block_t: int = 1
    block_h: int = 2048
    num_warps: int = 8
    num_stages: int = 1
    has_eviction_hints: bool = True

    def __post_init__(self):
        for name in ("block_t", "block_h", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"UnpermuteConfig.{name}={value} but a power of two is needed")
        if self.num_stages < 1:
            raise ValueError(f"UnpermuteConfig.num_stages={self.num_stages} but >= 1 is needed")


def heuristic_config(num_tokens: int, hidden: int) -> UnpermuteConfig:
    """Block sizes for reducing `num_tokens` tokens of `hidden` columns.

    About 2048 columns per program (1 token x 2048 or 2 x 1024) at 8 warps: all k gathered tiles
    are in flight at once (BENCHMARKS.md, Thresholds: "PERMUTES, UNPERMUTES `pallas_then_xla`").
    """
    block_h = _triton.hidden_block(hidden, cap=2048)
    block_t = min(max(1, 2048 // block_h), _triton.next_power_of_2(num_tokens))
    return UnpermuteConfig(block_t=block_t, block_h=block_h, num_warps=8, num_stages=1)


def _unpermute_kernel(
    # inputs
    inverse_ref,
    weights_ref,
    y_ref,
    # outputs
    out_ref,
    *,
    block_t: int,
    block_h: int,
    num_tokens: int,
    topk: int,
    num_rows: int,
    hidden: int,
    has_eviction_hints: bool,
):
    """One [block_t, block_h] output tile; inverse_ref and weights_ref are flat [T*k]."""
    tokens = pl.program_id(0) * block_t + jnp.arange(block_t, dtype=jnp.int32)
    cols = pl.program_id(1) * block_h + jnp.arange(block_h, dtype=jnp.int32)
    token_ok = tokens < num_tokens
    col_ok = cols < hidden
    pair0 = jnp.where(token_ok, tokens, 0) * topk
    evict = "evict_first" if has_eviction_hints else None
    # All index loads, then all row loads, then the sums: k independent gathers in flight.
    slot_rows = [
        plt.load(inverse_ref.at[pair0 + slot], mask=token_ok, other=-1) for slot in range(topk)
    ]
    taken = [
        plt.load(
            y_ref.at[jnp.clip(row, 0, num_rows - 1)[:, None], cols[None, :]],
            mask=(row >= 0)[:, None] & col_ok[None, :],
            other=0,
            eviction_policy=evict,
        )
        for row in slot_rows
    ]
    acc = jnp.zeros((block_t, block_h), jnp.float32)
    for slot in range(topk):  # fixed slot order, as the reference
        value = taken[slot].astype(jnp.float32)
        if weights_ref is None:
            acc = acc + value
        else:
            weight = plt.load(weights_ref.at[pair0 + slot], mask=slot_rows[slot] >= 0, other=0.0)
            acc = acc + value * weight[:, None]
    plt.store(
        out_ref.at[tokens[:, None], cols[None, :]],
        acc.astype(out_ref.dtype),
        mask=token_ok[:, None] & col_ok[None, :],
        eviction_policy=evict,
    )


def _weightless_kernel(inverse_ref, y_ref, out_ref, **kwargs):
    _unpermute_kernel(inverse_ref, None, y_ref, out_ref, **kwargs)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def unpermute(
    y: jax.Array,
    inverse: jax.Array,
    topk_weights: jax.Array | None,
    *,
    out_dtype: jnp.dtype | None = None,
    config: UnpermuteConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """out[t] = sum over valid slots j of w[t, j] * y[inverse[t, j]], in float32, slot order.

    Matches `moe_jax.layouts.unpermute_reference` (float32 products and sums in slot order; on GPU
    the compiler may fuse a product and a sum into one rounding).

    Arguments and result as `moe_jax.permute.unpermute`, whose checks and empty-axis answers
    this kernel relies on: y bf16, float16 or float32 with M, H >= 1; T, k >= 1. Rows of
    `inverse` outside [-1, M) are clamped, so the kernel never reads out of bounds.

    Args:
      config: block sizes; None picks `heuristic_config(T, H)`.
      interpret: run the Pallas kernel in interpret mode (CPU tests).

    Example:
      >>> y = jnp.arange(6.0).reshape(3, 2)
      >>> unpermute(y, jnp.array([[2, 0], [-1, 1]], jnp.int32),
      ...           jnp.array([[0.5, 2.0], [1.0, -1.0]]), interpret=True).tolist()
      [[2.0, 4.5], [-2.0, -3.0]]
    """
    out_dtype = jnp.dtype(y.dtype if out_dtype is None else out_dtype)
    num_tokens, topk = inverse.shape
    num_rows, hidden = y.shape
    if config is None:
        config = heuristic_config(num_tokens, hidden)
    block_h = min(config.block_h, _triton.next_power_of_2(hidden))
    grid = (pl.cdiv(num_tokens, config.block_t), pl.cdiv(hidden, block_h))
    static = dict(
        block_t=config.block_t,
        block_h=block_h,
        num_tokens=num_tokens,
        topk=topk,
        num_rows=num_rows,
        hidden=hidden,
        has_eviction_hints=config.has_eviction_hints,
    )
    operands = [inverse.reshape(-1)]
    if topk_weights is None:
        kernel = functools.partial(_weightless_kernel, **static)
    else:
        kernel = functools.partial(_unpermute_kernel, **static)
        operands.append(topk_weights.astype(jnp.float32).reshape(-1))
    with _triton.quiet_triton_deprecation():
        return pl.pallas_call(
            kernel,
            grid=grid,
            out_shape=jax.ShapeDtypeStruct((num_tokens, hidden), out_dtype),
            interpret=interpret,
            compiler_params=_triton.compiler_params(
                num_warps=config.num_warps, num_stages=config.num_stages
            ),
            name=f"unpermute_{config.block_t=}_{block_h=}_{config.num_warps=}"
            f"_{config.has_eviction_hints=}",
        )(*operands, y)
