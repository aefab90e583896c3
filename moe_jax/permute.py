"""Layout ops: permute (tokens -> expert-contiguous rows), unpermute (rows -> weighted token sums)
and per-expert token counts, each with a registry of implementations.

Implementations, chosen by `impl` through `moe_jax.registry` (the same rule as every op):

- "xla": the pure-JAX references in `moe_jax.layouts`; runs everywhere.
- "pallas": the Pallas Triton kernels in `moe_jax.kernels`; NVIDIA GPUs only.
- "pallas_interpret": the same kernels in Pallas interpret mode (CPU tests; never automatic).
- "auto": "pallas" on a GPU, "xla" elsewhere (`registry.pallas_then_xla`).

Every implementation returns bit-identical layouts; unpermute sums in float32 in slot order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax import layouts
from moe_jax.registry import AUTO, FunctionImpl, OpProblem, Registry, pallas_then_xla

_KERNEL_MODULES = {
    "permute": "moe_jax.kernels.permute",
    "unpermute": "moe_jax.kernels.unpermute",
    "count": "moe_jax.kernels.count",
}


def _registry(op: str, kernel_module: str) -> Registry:
    return Registry(
        op,
        preference=pallas_then_xla,
        modules={"pallas": kernel_module, "pallas_interpret": kernel_module},
    )


PERMUTES = _registry("permute", _KERNEL_MODULES["permute"])
UNPERMUTES = _registry("unpermute", _KERNEL_MODULES["unpermute"])
COUNTS = _registry("count_expert_num_tokens", _KERNEL_MODULES["count"])
PERMUTES.register(FunctionImpl("xla", layouts.permute_reference))
UNPERMUTES.register(FunctionImpl("xla", layouts.unpermute_reference))
COUNTS.register(FunctionImpl("xla", layouts.count_expert_num_tokens))


def problem_for(x: jax.Array) -> OpProblem:
    """The `OpProblem` of an op whose main operand is `x`, on the default backend."""
    return OpProblem(platform=jax.default_backend(), dtype=jnp.dtype(x.dtype).name)


def permute(
    x: jax.Array,
    topk_ids: jax.Array,
    *,
    num_experts: int,
    x_scales: jax.Array | None = None,
    expert_map: jax.Array | None = None,
    alignment: int = layouts.DEFAULT_ALIGNMENT,
    impl: str = AUTO,
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
      impl: "auto", "xla", "pallas", "pallas_interpret" or an implementation object.

    Returns:
      `moe_jax.layouts.ContiguousLayout`.

    Example:
      >>> lay = permute(jnp.ones((2, 4)), jnp.array([[1], [1]]), num_experts=2, alignment=1)
      >>> lay.expert_ids.tolist()
      [1, 1]
    """
    chosen = PERMUTES.select(impl, problem_for(x))
    return chosen(
        x,
        topk_ids,
        num_experts=num_experts,
        x_scales=x_scales,
        expert_map=expert_map,
        alignment=alignment,
    )


def unpermute(
    y: jax.Array,
    inverse: jax.Array,
    topk_weights: jax.Array | None,
    *,
    out_dtype: jnp.dtype | None = None,
    impl: str = AUTO,
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
    chosen = UNPERMUTES.select(impl, problem_for(y))
    return chosen(y, inverse, topk_weights, out_dtype=out_dtype)


def count_expert_num_tokens(
    topk_ids: jax.Array,
    num_local_experts: int,
    expert_map: jax.Array | None = None,
    *,
    impl: str = AUTO,
) -> jax.Array:
    """int32[E_local] (token, slot) pairs per local expert; duplicates count twice, invalid ids
    nowhere (see `moe_jax.layouts.count_expert_num_tokens`).

    Args:
      topk_ids: int[T, k] expert ids (global if `expert_map` is given).
      num_local_experts: E_local.
      expert_map: optional int[E_global] global-to-local map, -1 for experts held elsewhere.
      impl: as for `permute`.

    Example:
      >>> count_expert_num_tokens(jnp.array([[0, 0], [2, 1]]), 2).tolist()
      [2, 1]
    """
    chosen = COUNTS.select(impl, problem_for(topk_ids))
    return chosen(topk_ids, num_local_experts, expert_map)
