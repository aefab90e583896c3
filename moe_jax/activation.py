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


def act_and_mul(x: jax.Array, activation: str = "silu") -> jax.Array:
    """act(x[..., :I]) * x[..., I:] for x of shape [..., 2I], in x's dtype.

    Example:
      >>> act_and_mul(jnp.array([[0.0, 3.0]])).tolist()
      [[0.0]]
    """
    check_activation(activation)
    half = x.shape[-1] // 2
    if x.shape[-1] != 2 * half:
        raise ValueError(f"x.shape={x.shape}: the last dimension must be even (gate, then up)")
    gate = ACTIVATIONS[activation](x[..., :half].astype(jnp.float32)).astype(x.dtype)
    return gate * x[..., half:]
