"""Permute (tokens -> contiguous expert-major rows) and unpermute (rows -> weighted token sums).

Front module with one switch, `impl`:

- "xla": the pure-JAX references in `moe_jax.layouts` (default off the GPU).
- "pallas": the Pallas GPU kernels in `moe_jax.kernels` (default on NVIDIA GPUs).
- "pallas_interpret": the same kernels in Pallas interpret mode (CPU tests).

Every implementation returns bit-identical layouts; unpermute sums in float32 in slot order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax import layouts

IMPLS = ("xla", "pallas", "pallas_interpret")


def default_impl() -> str:
    """ "pallas" where the default backend is a GPU, else "xla"."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def resolve_impl(impl: str | None) -> str:
    """`impl` checked, with None replaced by `default_impl()`."""
    impl = default_impl() if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"unknown permute impl {impl!r}; choose from {list(IMPLS)} or None")
    return impl


def permute(
    x: jax.Array,
    topk_ids: jax.Array,
    *,
    num_experts: int,
    x_scales: jax.Array | None = None,
    expert_map: jax.Array | None = None,
    alignment: int = layouts.DEFAULT_ALIGNMENT,
    impl: str | None = None,
) -> layouts.ContiguousLayout:
    """Copies each token once per chosen local expert into expert-contiguous rows.

    Args:
      x: [T, H] tokens (bf16, float32 or float8_e4m3fn).
      topk_ids: int[T, k] expert per slot; ids outside [0, E) after `expert_map` send that copy
        nowhere and never address memory.
      num_experts: E, the number of local experts.
      x_scales: optional float32[T, H // 128] scales of FP8 tokens, permuted with the rows.
      expert_map: optional int[E_global] global-to-local map, -1 for experts held elsewhere.
      alignment: segment length multiple (128 for DeepGEMM).
      impl: "xla", "pallas", "pallas_interpret" or None (see module docstring).

    Returns:
      `moe_jax.layouts.ContiguousLayout`.
    """
    impl = resolve_impl(impl)
    if impl == "xla":
        return layouts.permute_reference(
            x,
            topk_ids,
            num_experts=num_experts,
            x_scales=x_scales,
            expert_map=expert_map,
            alignment=alignment,
        )
    from moe_jax import kernels

    return kernels.permute(
        x,
        topk_ids,
        num_experts=num_experts,
        x_scales=x_scales,
        expert_map=expert_map,
        alignment=alignment,
        interpret=impl == "pallas_interpret",
    )


def unpermute(
    y: jax.Array,
    inverse: jax.Array,
    topk_weights: jax.Array | None,
    *,
    out_dtype: jnp.dtype | None = None,
    impl: str | None = None,
) -> jax.Array:
    """out[t] = sum over valid slots j of w[t, j] * y[inverse[t, j]], in float32, slot order.

    Args:
      y: [M, H] expert outputs in row layout.
      inverse: int32[T, k] row of each (token, slot), -1 for none.
      topk_weights: float[T, k], or None when weights were applied before.
      out_dtype: output dtype (default y.dtype).
      impl: as for `permute`.

    Returns:
      [T, H] in `out_dtype`.
    """
    impl = resolve_impl(impl)
    if impl == "xla":
        return layouts.unpermute_reference(y, inverse, topk_weights, out_dtype=out_dtype)
    from moe_jax import kernels

    return kernels.unpermute(
        y, inverse, topk_weights, out_dtype=out_dtype, interpret=impl == "pallas_interpret"
    )
