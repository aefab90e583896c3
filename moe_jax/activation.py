"""Gated activations of the expert MLP: act(gate) * up on the first GEMM's [.., 2I] output.

vLLM rounds like this (`silu_and_mul`): act in float32, cast to the tensor dtype, then the product
in that dtype, so bf16 sees two roundings. We do the same.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp


def _silu(x: jax.Array) -> jax.Array:
    return x / (1.0 + jnp.exp(-x))


def _gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)


def _silu_grad(x: jax.Array) -> jax.Array:
    """d silu / dx = s * (1 + x * (1 - s)), s = sigmoid(x)."""
    s = 1.0 / (1.0 + jnp.exp(-x))
    return s * (1.0 + x * (1.0 - s))


def _gelu_grad(x: jax.Array) -> jax.Array:
    """d (x * Phi(x)) / dx = Phi(x) + x * phi(x), Phi and phi of the standard normal."""
    cdf = 0.5 * (1.0 + jax.lax.erf(x / math.sqrt(2.0)))
    return cdf + x * jnp.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {"silu": _silu, "gelu": _gelu}
ACTIVATION_GRADS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": _silu_grad,
    "gelu": _gelu_grad,
}


def check_activation(name: str) -> None:
    """Raises ValueError naming the valid activations unless `name` is one of `ACTIVATIONS`."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose from {sorted(ACTIVATIONS)}")


def round_to_dtype(x: jax.Array, dtype) -> jax.Array:
    """float32 `x` rounded (to nearest even) to `dtype` and cast there.

    A plain `astype` is not enough under `jax.jit`: XLA's excess-precision simplification may keep
    the float32 value through a bf16 round trip, which changes vLLM's two-rounding numerics.
    `reduce_precision` is an explicit rounding XLA keeps (it fuses, so it costs nothing), but it
    flushes subnormals to zero, which matters for float16 only; float16 goes through an
    optimization barrier instead.
    """
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return x.astype(jnp.float32)
    if dtype == jnp.bfloat16:
        rounded = jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
        return rounded.astype(dtype)
    return jax.lax.optimization_barrier(x.astype(dtype))


def gated_activation(
    gate: jax.Array,
    up: jax.Array,
    activation: str = "silu",
    *,
    round_fn=round_to_dtype,
    act_fn: Callable[[jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """act(gate) * up in up's dtype: act in float32, rounded, then the product rounded.

    `round_fn(x_f32, dtype)` does the roundings; kernels that round exactly with a plain cast
    (Triton on GPU) pass their own. `act_fn` replaces `ACTIVATIONS[activation]` for a kernel
    that spells the activation its own way (float32 in, float32 out).
    """
    act_fn = ACTIVATIONS[activation] if act_fn is None else act_fn
    act = round_fn(act_fn(gate.astype(jnp.float32)), up.dtype)
    return round_fn(act.astype(jnp.float32) * up.astype(jnp.float32), up.dtype)


def act_and_mul(
    x: jax.Array, activation: str = "silu", *, row_mask: jax.Array | None = None
) -> jax.Array:
    """act(x[..., :I]) * x[..., I:] for x of shape [..., 2I], in x's dtype (vLLM's rounding).

    Args:
      x: [..., 2I] float gate columns, then up columns.
      activation: a name of `ACTIVATIONS`.
      row_mask: optional bool[...] (x.shape[:-1]); rows where it is False come out as zeros and
        get a zero gradient (padding rows of a layout).

    Returns:
      [..., I] in x's dtype.

    Differentiable with a custom VJP that keeps only x (and the mask) for the backward, which
    recomputes the activation in float32 in one pass: 2 * 2I bytes per bf16 row, instead of the
    float32 intermediates autodiff would save. The rounding steps are straight-through.

    Example:
      >>> act_and_mul(jnp.array([[0.0, 3.0]])).tolist()
      [[0.0]]
    """
    check_activation(activation)
    half = x.shape[-1] // 2
    if x.shape[-1] != 2 * half:
        raise ValueError(f"x.shape={x.shape}: the last dimension must be even (gate, then up)")
    if row_mask is not None and row_mask.shape != x.shape[:-1]:
        raise ValueError(f"row_mask.shape={row_mask.shape} must be x.shape[:-1]={x.shape[:-1]}")
    if x.dtype not in (jnp.float16, jnp.bfloat16, jnp.float32):  # float64 would run in float32
        raise TypeError(f"x.dtype={x.dtype}: act_and_mul needs float16, bfloat16 or float32 x")
    return _act_and_mul_vjp(activation, x, row_mask)


def _masked(a: jax.Array, row_mask: jax.Array | None) -> jax.Array:
    if row_mask is None:
        return a
    return jnp.where(row_mask[..., None], a, jnp.zeros((), a.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _act_and_mul_vjp(activation: str, x: jax.Array, row_mask: jax.Array | None) -> jax.Array:
    half = x.shape[-1] // 2
    return _masked(gated_activation(x[..., :half], x[..., half:], activation), row_mask)


def _act_and_mul_fwd(activation, x, row_mask):
    return _act_and_mul_vjp(activation, x, row_mask), (x, row_mask)


def _act_and_mul_bwd(activation, residuals, cotangent):
    x, row_mask = residuals
    half = x.shape[-1] // 2
    gate = x[..., :half].astype(jnp.float32)
    up = x[..., half:].astype(jnp.float32)
    # The forward's product uses the activation rounded to x's dtype; so does its derivative.
    act = round_to_dtype(ACTIVATIONS[activation](gate), x.dtype).astype(jnp.float32)
    g = _masked(cotangent.astype(jnp.float32), row_mask)
    d_gate = g * up * ACTIVATION_GRADS[activation](gate)
    return jnp.concatenate([d_gate, g * act], axis=-1).astype(x.dtype), None


_act_and_mul_vjp.defvjp(_act_and_mul_fwd, _act_and_mul_bwd)
