"""`fused_moe`: the functional front door (vLLM's `fused_experts` over the modular kernel)."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from moe_jax import quant
from moe_jax.experts import Experts
from moe_jax.experts_by_name import resolve_experts
from moe_jax.modular import ModularMoE
from moe_jax.prepare_finalize import NoEPPrepareFinalize
from moe_jax.routing import require_static

# Arguments that set shapes or choose code: under `jax.jit` they must be static.
_STATIC_ARGNAMES = (
    "activation",
    "apply_router_weight_on_input",
    "global_num_experts",
    "chunk_size",
    "experts",
    "block_shape",
)


def fused_moe(
    hidden_states: jax.Array,
    w1: jax.Array,
    w2: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    *,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    global_num_experts: int | None = None,
    expert_map: jax.Array | None = None,
    w1_scale: jax.Array | None = None,
    w2_scale: jax.Array | None = None,
    block_shape: Sequence[int] | None = None,
    chunk_size: int | None = None,
    experts: str | Experts = "auto",
) -> jax.Array:
    """Mixture-of-experts MLP of routed tokens, with vLLM's semantics.

    out[t] = sum_j w[t, j] * W2[e] @ (act(W1_gate[e] @ x[t]) * (W1_up[e] @ x[t])), e = ids[t, j],
    over slots whose id maps to a local expert. Duplicate ids in a row add up; negative weights are
    fine; ids outside [0, E) (after `expert_map`) contribute nothing and never index memory.

    Args:
      hidden_states: [T, H] bfloat16, float16 or float32 tokens.
      w1: [E, 2I, H] gate rows [0, I) then up rows [I, 2I); float, or float8_e4m3fn with w1_scale
        (FP8: H and I multiples of 128).
      w2: [E, H, I]; same dtype as w1.
      topk_weights: float[T, k] router weights.
      topk_ids: int[T, k] expert ids (global ids when `expert_map` is given).
      activation: "silu" or "gelu" (applied to the gate half).
      apply_router_weight_on_input: scale x by its weight before the experts (top-1 only).
      global_num_experts: E_global, or None; checked against `expert_map`, or equal to E without
        one.
      expert_map: int[E_global] local index of each global expert, -1 where held elsewhere;
        E_global >= E. Ids at or past E_global (which the map does not cover) contribute nothing.
      w1_scale: float32[E, 2I/128, H/128] block scales of FP8 w1; only with FP8 weights (scales
        given with float weights raise, they would otherwise be ignored).
      w2_scale: float32[E, H/128, I/128] block scales of FP8 w2.
      block_shape: the FP8 weights' tile, as vLLM's `fused_experts` takes it: None, or
        [128, 128] (the only tile the FP8 path runs) with FP8 weights and their scales.
      chunk_size: run the experts over chunks of at most this many tokens (static shapes).
      experts: "auto" (the fastest that runs here), a name from `moe_jax.experts_names()`
        ("xla", "deep_gemm", "torch", ..., "deep_gemm_masked", ...), or an `Experts` object.

    Returns:
      [T, H] in hidden_states.dtype.

    Differentiable; FP8 weights are held constant (a gradient to them or their scales raises
    a TypeError), and the others go straight through the FP8 forward's quantizers
    (`ModularMoE.forward`).

    Under `jax.jit`, the arguments that are not arrays are static (a traced one raises a
    TypeError naming it): `jax.jit(fused_moe, static_argnames=("activation",
    "apply_router_weight_on_input", "global_num_experts", "chunk_size", "experts",
    "block_shape"))`, with block_shape a tuple (static arguments must be hashable).

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones((2, 8)); w1 = jnp.ones((2, 4, 8)) / 8; w2 = jnp.ones((2, 8, 2))
      >>> out = fused_moe(x, w1, w2, jnp.array([[1.0], [-1.0]]), jnp.array([[0], [5]]))
      >>> [round(v, 4) for v in out[:, 0].tolist()]  # token 1 went to a missing expert
      [1.4621, 0.0]
    """
    require_static("fused_moe", _STATIC_ARGNAMES, locals())
    if block_shape is not None:
        _check_block_shape(block_shape, w1, w1_scale)
    layer = ModularMoE(NoEPPrepareFinalize(), resolve_experts(experts), chunk_size=chunk_size)
    return layer(
        hidden_states, w1, w2, topk_weights, topk_ids, activation=activation,
        global_num_experts=global_num_experts, expert_map=expert_map, w1_scale=w1_scale,
        w2_scale=w2_scale, apply_router_weight_on_input=apply_router_weight_on_input,
    )  # fmt: skip


def _check_block_shape(block_shape: Sequence[int], w1: jax.Array, w1_scale) -> None:
    """vLLM's `block_shape=[128, 128]` names the tile the scales were made for: accept the one
    tile the FP8 path runs, and only beside FP8 weights (the scales' shapes are checked against
    it with the other inputs)."""
    try:
        shape = tuple(block_shape)
    except TypeError:
        shape = None
    if shape != quant.DEFAULT_BLOCK_SHAPE:
        raise ValueError(
            f"block_shape={block_shape!r}: only {list(quant.DEFAULT_BLOCK_SHAPE)} FP8 weight "
            "tiles are supported (vLLM's and DeepSeek-V3's block recipe, DeepGEMM's layout); "
            "quantize with moe_jax.quant.per_block_quant_fp8(w), whose default tile it is"
        )
    if w1.dtype != quant.FP8_DTYPE or w1_scale is None:
        raise ValueError(
            f"block_shape={block_shape!r} describes FP8 block-quantized weights, but "
            f"w1.dtype={w1.dtype} and w1_scale is {'None' if w1_scale is None else 'given'}: "
            "pass float8_e4m3fn w1/w2 with w1_scale/w2_scale (moe_jax.quant.per_block_quant_fp8), "
            "or block_shape=None for float weights"
        )
