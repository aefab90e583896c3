"""`fused_moe`: the functional front door (vLLM's `fused_experts` over the modular kernel)."""

from __future__ import annotations

import jax

from moe_jax.experts import Experts
from moe_jax.experts_by_name import resolve_experts
from moe_jax.modular import ModularMoE
from moe_jax.prepare_finalize import NoEPPrepareFinalize


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
      chunk_size: run the experts over chunks of at most this many tokens (static shapes).
      experts: "auto" (the fastest that runs here), a name from `moe_jax.experts_names()`
        ("xla", "deep_gemm", "torch", ..., "deep_gemm_masked", ...), or an `Experts` object.

    Returns:
      [T, H] in hidden_states.dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones((2, 8)); w1 = jnp.ones((2, 4, 8)) / 8; w2 = jnp.ones((2, 8, 2))
      >>> out = fused_moe(x, w1, w2, jnp.array([[1.0], [-1.0]]), jnp.array([[0], [5]]))
      >>> [round(v, 4) for v in out[:, 0].tolist()]  # token 1 went to a missing expert
      [1.4621, 0.0]
    """
    layer = ModularMoE(NoEPPrepareFinalize(), resolve_experts(experts), chunk_size=chunk_size)
    return layer(
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation=activation,
        global_num_experts=global_num_experts,
        expert_map=expert_map,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        apply_router_weight_on_input=apply_router_weight_on_input,
    )
