"""The checks every MoE layer entry point makes on its arguments (`fused_moe`, `ModularMoE`,
`moe_reference`): shapes, dtypes, scales and maps, each error naming the argument at fault.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax import quant
from moe_jax.activation import check_activation
from moe_jax.routing import require_int


def check_moe_inputs(
    hidden_states: jax.Array,
    w1: jax.Array,
    w2: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    *,
    w1_scale: jax.Array | None,
    w2_scale: jax.Array | None,
    expert_map: jax.Array | None,
    global_num_experts: int | None,
    apply_router_weight_on_input: bool,
    activation: str,
) -> None:
    """Raises ValueError/TypeError (at trace time) for inputs the layer cannot run."""
    check_activation(activation)
    if hidden_states.ndim != 2:
        raise ValueError(f"hidden_states.shape={hidden_states.shape} but [T, H] is needed")
    if hidden_states.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise TypeError(
            f"hidden_states.dtype={hidden_states.dtype}; use bfloat16, float16 or "
            "float32 (FP8 activations are produced inside from the weights' recipe)"
        )
    num_tokens, hidden = hidden_states.shape
    if w1.ndim != 3 or w2.ndim != 3:
        raise ValueError(f"{w1.shape=} and {w2.shape=} must be [E, 2I, H] and [E, H, I]")
    # H comes from hidden_states, E from w1, I from w2; name whichever disagrees with the rest.
    num_experts, inter = w1.shape[0], w2.shape[2]
    if w1.shape[2] != hidden and w2.shape[1] == w1.shape[2]:
        raise ValueError(
            f"hidden_states.shape={hidden_states.shape} but the weights have H={w1.shape[2]} "
            f"(w1.shape={w1.shape}, w2.shape={w2.shape}): the last dimension of hidden_states "
            "must be the weights' H"
        )
    if w1.shape[2] == hidden and w1.shape[1] % 2 == 0 and w1.shape[1] not in (inter, 2 * inter):
        # w1 is a whole [E, 2I, H] (not the gate half alone, [E, I, H]): w2's I is the odd one.
        raise ValueError(
            f"w2.shape={w2.shape} but [E, H, I] = {(num_experts, hidden, w1.shape[1] // 2)} is "
            f"needed to match w1.shape={w1.shape} (I = w1.shape[1] // 2: gate rows, then up rows)"
        )
    if w1.shape[2] != hidden or w1.shape[1] != 2 * inter:
        raise ValueError(
            f"w1.shape={w1.shape} but [E, 2I, H] = {(num_experts, 2 * inter, hidden)} is needed "
            f"(H from hidden_states.shape={hidden_states.shape}, I from w2.shape={w2.shape}; "
            "w1 holds the gate rows, then the up rows)"
        )
    if w2.shape != (num_experts, hidden, inter):
        raise ValueError(
            f"w2.shape={w2.shape} but [E, H, I] = {(num_experts, hidden, inter)} "
            f"is needed to match w1.shape={w1.shape}"
        )
    if w1.dtype != w2.dtype:
        raise TypeError(f"{w1.dtype=} differs from {w2.dtype=}")
    if w1.dtype == quant.FP8_DTYPE:
        block = quant.DEFAULT_BLOCK_SHAPE[0]
        if hidden % block or inter % block:
            raise ValueError(
                f"FP8 block weights need H and I to be multiples of {block}: H={hidden}, I={inter}"
            )
        for name, w, s in (("w1", w1, w1_scale), ("w2", w2, w2_scale)):
            expected = quant.block_scale_shape(w.shape)
            if s is None:
                raise ValueError(f"{name} is float8_e4m3fn: pass {name}_scale of shape {expected}")
            if s.shape != expected or s.dtype != jnp.float32:
                raise ValueError(
                    f"{name}_scale is {s.dtype}{list(s.shape)} but float32"
                    f"{list(expected)} is needed for {name}.shape={w.shape} (one scale per "
                    f"{block}x{block} tile: block_shape={list(quant.DEFAULT_BLOCK_SHAPE)})"
                )
    elif not jnp.issubdtype(w1.dtype, jnp.floating):
        raise TypeError(f"w1.dtype={w1.dtype}; use a float dtype or float8_e4m3fn with scales")
    else:
        for name, s in (("w1_scale", w1_scale), ("w2_scale", w2_scale)):
            if s is not None:
                raise ValueError(
                    f"{name} was given but w1.dtype={w1.dtype}: block scales belong to "
                    "float8_e4m3fn weights (quantize with moe_jax.quant.per_block_quant_fp8, "
                    "or drop the scales)"
                )
    if topk_ids.ndim != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids.shape={topk_ids.shape} but [T={num_tokens}, k] is needed")
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise TypeError(f"topk_ids.dtype={topk_ids.dtype} but an integer dtype is needed")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights.shape={topk_weights.shape} must equal topk_ids.shape={topk_ids.shape}"
        )
    if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
        raise TypeError(f"topk_weights.dtype={topk_weights.dtype} but a float dtype is needed")
    if apply_router_weight_on_input and topk_ids.shape[1] != 1:
        raise ValueError(
            f"apply_router_weight_on_input needs top-1 routing, got topk_ids.shape={topk_ids.shape}"
        )
    if global_num_experts is not None:
        require_int("global_num_experts", global_num_experts)
        if expert_map is None and global_num_experts != num_experts:
            raise ValueError(
                f"global_num_experts={global_num_experts} but w1.shape={w1.shape} holds all "
                f"{num_experts} experts (no expert_map): pass {num_experts}, or None, or an "
                "expert_map when the weights hold a shard of the experts"
            )
    if expert_map is not None:
        if expert_map.ndim != 1 or not jnp.issubdtype(expert_map.dtype, jnp.integer):
            raise ValueError(
                f"expert_map is {expert_map.dtype}{list(expert_map.shape)} but "
                "int[E_global] is needed"
            )
        if expert_map.shape[0] < num_experts:
            raise ValueError(
                f"expert_map.shape={expert_map.shape} maps fewer global experts than the "
                f"{num_experts} local experts of w1.shape={w1.shape}: pass int[E_global] with "
                "E_global >= E (ids at or past E_global contribute nothing)"
            )
        if global_num_experts is not None and expert_map.shape[0] != global_num_experts:
            raise ValueError(
                f"expert_map.shape={expert_map.shape} but global_num_experts={global_num_experts}"
            )
