"""A float32 reference MoE: every expert on every token, masked (clear, slow, E times the work).

For demos and sanity checks on small shapes. FP8 weights are dequantized and activations are not
quantized, so the gap to `fused_moe` on FP8 weights is the activation quantization error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax import quant
from moe_jax.activation import act_and_mul
from moe_jax.layouts import map_expert_ids
from moe_jax.moe_inputs import check_moe_inputs


def moe_reference(
    hidden_states: jax.Array,
    w1: jax.Array,
    w2: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    *,
    activation: str = "silu",
    expert_map: jax.Array | None = None,
    w1_scale: jax.Array | None = None,
    w2_scale: jax.Array | None = None,
    apply_router_weight_on_input: bool = False,
) -> jax.Array:
    """float32[T, H] MoE output; arguments as `moe_jax.fused_moe`, and checked as it checks them."""
    check_moe_inputs(
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        expert_map=expert_map,
        global_num_experts=None,
        apply_router_weight_on_input=apply_router_weight_on_input,
        activation=activation,
    )
    x = hidden_states.astype(jnp.float32)
    weights = topk_weights.astype(jnp.float32)
    if w1.dtype == quant.FP8_DTYPE:
        w1, w2 = quant.dequant_per_block(w1, w1_scale), quant.dequant_per_block(w2, w2_scale)
    w1, w2 = w1.astype(jnp.float32), w2.astype(jnp.float32)
    if apply_router_weight_on_input:
        x, weights = x * weights, jnp.ones_like(weights)
    local = map_expert_ids(topk_ids, num_experts=w1.shape[0], expert_map=expert_map)
    hi = jax.lax.Precision.HIGHEST
    out = jnp.zeros_like(x)
    for e in range(w1.shape[0]):
        h = act_and_mul(jnp.dot(x, w1[e].T, precision=hi), activation)
        y = jnp.dot(h, w2[e].T, precision=hi)
        out = out + y * jnp.sum(jnp.where(local == e, weights, 0.0), axis=1, keepdims=True)
    return out
