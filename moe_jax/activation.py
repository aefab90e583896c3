"""Gated activations of the expert MLP: act(gate) * up on the first GEMM's [.., 2I] output.

vLLM rounds like this (`silu_and_mul`): act in float32, cast to the tensor dtype, then the product
in that dtype, so bf16 sees two roundings. We do the same.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def _silu(x: jax.Array) -> jax.Array:
    return x / (1.0 + jnp.exp(-x))


def _gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {"silu": _silu, "gelu": _gelu}


def check_activation(name: str) -> None:
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
    gate: jax.Array, up: jax.Array, activation: str = "silu", *, round_fn=round_to_dtype
) -> jax.Array:
    """act(gate) * up in up's dtype: act in float32, rounded, then the product rounded.

    `round_fn(x_f32, dtype)` does the roundings; kernels that round exactly with a plain cast
    (Triton on GPU) pass their own.
    """
    act = round_fn(ACTIVATIONS[activation](gate.astype(jnp.float32)), up.dtype)
    return round_fn(act.astype(jnp.float32) * up.astype(jnp.float32), up.dtype)


def act_and_mul(x: jax.Array, activation: str = "silu") -> jax.Array:
    """act(x[..., :I]) * x[..., I:] for x of shape [..., 2I], in x's dtype (vLLM's rounding).

    Example:
      >>> act_and_mul(jnp.array([[0.0, 3.0]])).tolist()
      [[0.0]]
    """
    check_activation(activation)
    half = x.shape[-1] // 2
    if x.shape[-1] != 2 * half:
        raise ValueError(f"x.shape={x.shape}: the last dimension must be even (gate, then up)")
    return gated_activation(x[..., :half], x[..., half:], activation)
