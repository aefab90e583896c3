"""ModularMoE: PrepareAndFinalize + Experts (+ their WeightAndReduce), with optional chunking.

One forward, as in vLLM's FusedMoEModularKernel:

    prepared = prepare_finalize.prepare(x, weights, ids)      # scale / quantize / dispatch
    out      = experts.apply(prepared, ...)                   # per chunk of <= chunk_size tokens
    return     prepare_finalize.finalize(out, prepared, experts.weight_and_reduce())

Chunking runs the experts over fixed-size chunks with static shapes (`jax.lax.map`); each chunk
computes its own layout and per-expert counts; the tail chunk is padded with tokens routed nowhere
(id -1), which contribute nothing. The result equals the unchunked one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax import quant
from moe_jax.activation import check_activation
from moe_jax.experts import Experts, ExpertsCall, ExpertWeights
from moe_jax.prepare_finalize import PreparedTokens, PrepareFinalize


def check_moe_inputs(
    hidden_states: jax.Array,
    weights: ExpertWeights,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    *,
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
    w1, w2 = weights.w1, weights.w2
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
    if weights.is_fp8:
        block = quant.DEFAULT_BLOCK_SHAPE[0]
        if hidden % block or inter % block:
            raise ValueError(
                f"FP8 block weights need H and I to be multiples of {block}: H={hidden}, I={inter}"
            )
        for name, w, s in (("w1", w1, weights.w1_scale), ("w2", w2, weights.w2_scale)):
            expected = quant.block_scale_shape(w.shape)
            if s is None:
                raise ValueError(f"{name} is float8_e4m3fn: pass {name}_scale of shape {expected}")
            if s.shape != expected or s.dtype != jnp.float32:
                raise ValueError(
                    f"{name}_scale is {s.dtype}{list(s.shape)} but float32"
                    f"{list(expected)} is needed for {name}.shape={w.shape}"
                )
    elif not jnp.issubdtype(w1.dtype, jnp.floating):
        raise TypeError(f"w1.dtype={w1.dtype}; use a float dtype or float8_e4m3fn with scales")
    else:
        for name, s in (("w1_scale", weights.w1_scale), ("w2_scale", weights.w2_scale)):
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


@dataclasses.dataclass(frozen=True)
class ModularMoE:
    """An MoE layer forward assembled from one PrepareFinalize and one Experts object.

    Attributes:
      prepare_finalize: e.g. `NoEPPrepareFinalize()`.
      experts: e.g. `ContiguousExperts(gemm="xla")`.
      chunk_size: run the experts over chunks of at most this many tokens (None: one chunk).

    Example:
      >>> from moe_jax import ContiguousExperts, NoEPPrepareFinalize
      >>> moe = ModularMoE(NoEPPrepareFinalize(), ContiguousExperts(gemm="xla"), chunk_size=2)
      >>> x = jnp.ones((3, 8)); w1 = jnp.ones((2, 4, 8)) / 8; w2 = jnp.ones((2, 8, 2))
      >>> out = moe(x, w1, w2, jnp.full((3, 1), 0.5), jnp.array([[0], [1], [1]]))
      >>> out.shape, round(float(out[0, 0]), 4)
      ((3, 8), 0.7311)
    """

    prepare_finalize: PrepareFinalize
    experts: Experts
    chunk_size: int | None = None

    def __post_init__(self):
        chunk = self.chunk_size
        if chunk is not None and (
            not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0
        ):
            raise ValueError(f"chunk_size={chunk!r} must be a positive int or None")

    def __call__(
        self,
        hidden_states: jax.Array,
        w1: jax.Array,
        w2: jax.Array,
        topk_weights: jax.Array,
        topk_ids: jax.Array,
        **kwargs,
    ) -> jax.Array:
        """Runs the layer; keyword arguments as `forward` (and `moe_jax.fused_moe`).

        Returns:
          [T, H] in hidden_states.dtype. `forward` also returns the prepared tokens (with an
          expert-parallel prepare's dispatch statistics).
        """
        return self.forward(hidden_states, w1, w2, topk_weights, topk_ids, **kwargs)[0]

    def forward(
        self,
        hidden_states: jax.Array,
        w1: jax.Array,
        w2: jax.Array,
        topk_weights: jax.Array,
        topk_ids: jax.Array,
        *,
        activation: str = "silu",
        global_num_experts: int | None = None,
        expert_map: jax.Array | None = None,
        w1_scale: jax.Array | None = None,
        w2_scale: jax.Array | None = None,
        apply_router_weight_on_input: bool = False,
    ) -> tuple[jax.Array, PreparedTokens | None]:
        """Runs the layer; arguments as `moe_jax.fused_moe`.

        Returns:
          ([T, H] in the input dtype, the `PreparedTokens` the experts saw, None when T == 0);
          an expert-parallel prepare's tokens carry its dispatch statistics.
        """
        # NumPy (or other array-like) inputs become jax arrays here, at the boundary.
        hidden_states, w1, w2, topk_weights, topk_ids = map(
            jnp.asarray, (hidden_states, w1, w2, topk_weights, topk_ids)
        )
        w1_scale, w2_scale, expert_map = (
            None if a is None else jnp.asarray(a) for a in (w1_scale, w2_scale, expert_map)
        )
        weights = ExpertWeights(w1=w1, w2=w2, w1_scale=w1_scale, w2_scale=w2_scale)
        check_moe_inputs(
            hidden_states,
            weights,
            topk_weights,
            topk_ids,
            expert_map=expert_map,
            global_num_experts=global_num_experts,
            apply_router_weight_on_input=apply_router_weight_on_input,
            activation=activation,
        )
        quant_config = quant.Fp8BlockQuant() if weights.is_fp8 else None
        out_dtype = hidden_states.dtype
        num_tokens, hidden = hidden_states.shape
        if num_tokens == 0:
            return jnp.zeros((0, hidden), out_dtype), None
        prepared = self.prepare_finalize.prepare(
            hidden_states,
            topk_weights,
            topk_ids,
            quant_config=quant_config,
            apply_router_weight_on_input=apply_router_weight_on_input,
        )
        call = ExpertsCall(activation=activation, quant_config=quant_config, out_dtype=out_dtype)
        expert_output = self._run_experts(prepared, weights, expert_map=expert_map, call=call)
        out = self.prepare_finalize.finalize(
            expert_output, prepared, self.experts.weight_and_reduce(), out_dtype=out_dtype
        )
        return out, prepared

    def _run_experts(self, prepared: PreparedTokens, weights, *, expert_map, call) -> jax.Array:
        num_tokens = prepared.x.shape[0]
        chunk = self.chunk_size
        if chunk is None or num_tokens <= chunk:
            return self.experts.apply(prepared, weights, expert_map=expert_map, call=call)
        num_chunks = -(-num_tokens // chunk)
        pad = num_chunks * chunk - num_tokens

        def to_chunks(a: jax.Array | None, fill) -> jax.Array | None:
            if a is None:
                return None
            padded = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
            return padded.reshape(num_chunks, chunk, *a.shape[1:])

        chunks = PreparedTokens(
            x=to_chunks(prepared.x, 0),
            x_scales=to_chunks(prepared.x_scales, 0),
            topk_ids=to_chunks(prepared.topk_ids, -1),  # padding tokens go nowhere
            topk_weights=to_chunks(prepared.topk_weights, 0),
        )
        outputs = jax.lax.map(
            lambda c: self.experts.apply(c, weights, expert_map=expert_map, call=call), chunks
        )
        return outputs.reshape(num_chunks * chunk, *outputs.shape[2:])[:num_tokens]
