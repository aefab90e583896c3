"""FP8 (e4m3fn) quantization with vLLM's block recipe.

Activations are quantized per token per `group_size`-wide group of hidden columns; weights per
`block_shape` tile. Both use vLLM's `per_token_group_quant_fp8` formula:

    scale = max(amax(group), 1e-10) / 448        q = clip(x / scale, -448, 448) -> float8_e4m3fn

with float32 scales and round-to-nearest-even in the cast. The scale layout is row-major
(`[T, H // group_size]`); backends that want another layout (DeepGEMM's MN-major, TMA-aligned one)
transpose at their boundary.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0
SCALE_EPS = 1e-10
DEFAULT_BLOCK_SHAPE = (128, 128)


def divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """a / b correctly rounded, as vLLM divides (not a * (1 / b), which differs in the last bit).

    XLA's algebraic simplifier rewrites A / broadcast(B) into A * broadcast(1 / B); dividing by a
    full-shape operand behind an optimization barrier keeps the true division.
    """
    return a / jax.lax.optimization_barrier(jnp.broadcast_to(b, a.shape))


def _check_floating(x: jax.Array, name: str) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == FP8_DTYPE:
        raise TypeError(f"{name}.dtype={x.dtype} but a float16/bfloat16/float32 array is needed")


def per_token_group_quant_fp8(x: jax.Array, group_size: int = 128) -> tuple[jax.Array, jax.Array]:
    """Quantizes activations to FP8 per token and per `group_size` columns.

    Args:
      x: float[..., H] activations (any float dtype; computed in float32).
      group_size: columns per scale; H must be a multiple of it (`fused_moe`'s FP8 path uses
        128).

    Returns:
      (q, scales): q float8_e4m3fn[..., H] and scales float32[..., H // group_size] with
      `x ~= q * scales` broadcast over each group.

    Example:
      >>> q, s = per_token_group_quant_fp8(jnp.full((2, 256), 4.0))
      >>> q.dtype, s.shape, float(s[0, 0] * 448)
      (dtype(float8_e4m3fn), (2, 2), 4.0)
    """
    _check_floating(x, "x")
    hidden = x.shape[-1]
    if group_size <= 0 or hidden % group_size:
        raise ValueError(
            f"x.shape={x.shape}: its last dimension H={hidden} must be a multiple of "
            f"{group_size=} (a positive group width); pad H or pick a group_size that divides it"
        )
    groups = x.astype(jnp.float32).reshape(*x.shape[:-1], hidden // group_size, group_size)
    amax = jnp.max(jnp.abs(groups), axis=-1, keepdims=True)
    scales = divide(jnp.maximum(amax, SCALE_EPS), jnp.float32(FP8_MAX))
    q = jnp.clip(divide(groups, scales), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return q.reshape(x.shape), scales[..., 0]


def dequant_per_token_group(q: jax.Array, scales: jax.Array) -> jax.Array:
    """Inverse of `per_token_group_quant_fp8`: float32[..., H] = q * scales per group.

    Args:
      q: float8_e4m3fn[..., H].
      scales: float32[..., G] with H a multiple of G.
    """
    hidden, num_groups = q.shape[-1], scales.shape[-1]
    if q.shape[:-1] != scales.shape[:-1] or num_groups == 0 or hidden % num_groups:
        raise ValueError(f"{q.shape=} and {scales.shape=} do not describe per-group scales")
    grouped = q.astype(jnp.float32).reshape(*q.shape[:-1], num_groups, hidden // num_groups)
    return (grouped * scales[..., None]).reshape(q.shape)


def block_scale_shape(shape: tuple[int, ...], block_shape=DEFAULT_BLOCK_SHAPE) -> tuple[int, ...]:
    """Shape of the scales of a `[..., N, K]` weight in `block_shape` tiles (ragged edge tiles,
    as some checkpoints hold them, count as tiles)."""
    bn, bk = block_shape
    *lead, n, k = shape
    return (*lead, math.ceil(n / bn), math.ceil(k / bk))


def per_block_quant_fp8(
    w: jax.Array, block_shape: tuple[int, int] = DEFAULT_BLOCK_SHAPE
) -> tuple[jax.Array, jax.Array]:
    """Quantizes weights to FP8 with one scale per `block_shape` tile.

    N and K must be multiples of the tile's sides, as `fused_moe`'s FP8 path needs: with the
    default tile, H and I multiples of 128 once both w1 and w2 are quantized (w1's K is H, w2's
    is I). Keep other sizes in bfloat16.

    Args:
      w: float[..., N, K] weights (vLLM layout: w1 [E, 2I, H], w2 [E, H, I]).
      block_shape: (rows, columns) per scale; `fused_moe` runs (128, 128) only.

    Returns:
      (wq, scales): float8_e4m3fn[..., N, K] and float32[..., N/bn, K/bk], so that
      `w[n, k] ~= wq[n, k] * scales[n // bn, k // bk]`.

    Example:
      >>> wq, s = per_block_quant_fp8(jnp.ones((2, 256, 128)))
      >>> wq.dtype, s.shape
      (dtype(float8_e4m3fn), (2, 2, 1))
    """
    _check_floating(w, "w")
    bn, bk = block_shape
    if w.ndim < 2:
        raise ValueError(f"w.shape={w.shape} but [..., N, K] weights are needed")
    *lead, n, k = w.shape
    for size, tile, what in (
        (n, bn, "N (the rows: 2I of w1, H of w2)"),
        (k, bk, "K (the columns: H of w1, I of w2)"),
    ):
        if tile <= 0 or size % tile:
            raise ValueError(
                f"w.shape={w.shape}: {what} = {size} is not a multiple of the tile's {tile} "
                f"({block_shape=}); fused_moe's FP8 path needs H and I multiples of 128, so "
                "keep weights of other sizes in bfloat16"
            )
    tiles = w.astype(jnp.float32).reshape(*lead, n // bn, bn, k // bk, bk)
    amax = jnp.max(jnp.abs(tiles), axis=(-3, -1), keepdims=True)
    scales = divide(jnp.maximum(amax, SCALE_EPS), jnp.float32(FP8_MAX))
    q = jnp.clip(divide(tiles, scales), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return q.reshape(w.shape), scales[..., 0, :, 0]


def dequant_per_block(
    wq: jax.Array, scales: jax.Array, block_shape: tuple[int, int] = DEFAULT_BLOCK_SHAPE
) -> jax.Array:
    """Inverse of `per_block_quant_fp8`: float32[..., N, K] = wq * scales per tile."""
    expected = block_scale_shape(wq.shape, block_shape)
    if scales.shape != expected:
        raise ValueError(
            f"{wq.shape=} with {block_shape=} needs scales {expected}, got {scales.shape}"
        )
    bn, bk = block_shape
    *_, n, k = wq.shape
    full = jnp.repeat(jnp.repeat(scales, bn, axis=-2), bk, axis=-1)[..., :n, :k]
    return wq.astype(jnp.float32) * full


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8BlockQuant:
    """vLLM's block FP8 recipe: 128x128 weight tiles, activations per token per 128 columns.

    Attributes:
      block_shape: (rows, columns) of a weight tile; activations are grouped by the column size.
    """

    block_shape: tuple[int, int] = DEFAULT_BLOCK_SHAPE

    def __post_init__(self):
        if tuple(self.block_shape) != DEFAULT_BLOCK_SHAPE:
            raise ValueError(
                f"block_shape={self.block_shape}: only {DEFAULT_BLOCK_SHAPE} is supported "
                "(the layout DeepGEMM and vLLM's FP8 experts use)"
            )

    @property
    def group_size(self) -> int:
        return self.block_shape[1]

    def quantize_activations(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(float8_e4m3fn[..., H], float32[..., H // 128]) per `per_token_group_quant_fp8`."""
        return per_token_group_quant_fp8(x, self.group_size)
