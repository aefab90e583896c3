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
import functools

import jax
import jax.numpy as jnp

from moe_jax import quant
from moe_jax.experts import Experts, ExpertsCall, ExpertWeights
from moe_jax.grouped_gemm_backward import instantiate, primal_values
from moe_jax.moe_inputs import check_moe_inputs
from moe_jax.prepare_finalize import ActivationFormat, PreparedTokens, PrepareFinalize


@dataclasses.dataclass(frozen=True)
class ModularMoE:
    """An MoE layer forward assembled from one PrepareFinalize and one Experts object.

    Attributes:
      prepare_finalize: e.g. `NoEPPrepareFinalize()`.
      experts: e.g. `ContiguousExperts(gemm="xla")`; must consume the prepare's activation format
        (checked here, as vLLM does).
      chunk_size: run the experts over chunks of at most this many tokens (None: one chunk).
        Masked blocks, sized by their prepare, are not chunked.

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
        pf, fmt = type(self.prepare_finalize).__name__, self.prepare_finalize.activation_format
        if fmt not in self.experts.activation_formats:
            raise ValueError(
                f"{pf} delivers the {fmt.value} activation format but {self.experts.name} consumes "
                f"{[f.value for f in self.experts.activation_formats]}: masked prepares need "
                "MaskedExperts"
            )
        if chunk is not None and fmt is ActivationFormat.MASKED:
            raise ValueError(f"chunk_size={chunk} but {pf} delivers masked blocks: pass None")

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

        FP8 weights are held constant: a gradient to them or their scales raises a TypeError
        naming the argument. Not differentiated, the tokens are quantized in `prepare` (FP8 rows
        travel); under differentiation `prepare` gets float tokens and the experts' GEMMs
        quantize the rows inside their VJPs (the same values), so dL/dx and dL/dtopk_weights go
        straight through the quantizers, through any prepare whose collectives JAX transposes
        (a `gradient_refusal` prepare raises it instead).

        Returns:
          ([T, H] in the input dtype, the `PreparedTokens` the experts saw less their rows (x and
          x_scales None), None when T == 0): the routing, and an expert-parallel prepare's
          handle with its dispatch statistics. With FP8 weights it carries no gradient.
        """
        arrays = [
            None if a is None else jnp.asarray(a)  # array-likes become jax arrays here
            for a in (hidden_states, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, expert_map)
        ]
        check_moe_inputs(
            *arrays[:5], w1_scale=arrays[5], w2_scale=arrays[6], expert_map=arrays[7],
            global_num_experts=global_num_experts, activation=activation,
            apply_router_weight_on_input=apply_router_weight_on_input,
        )  # fmt: skip
        num_tokens, hidden = arrays[0].shape
        if num_tokens == 0:
            return jnp.zeros((0, hidden), arrays[0].dtype), None
        run = functools.partial(
            self._run, activation=activation, weight_on_input=apply_router_weight_on_input
        )
        refusal = self.prepare_finalize.gradient_refusal
        if arrays[1].dtype != quant.FP8_DTYPE and refusal is None:
            return run(*arrays)
        return _frozen_fp8(run, refusal)(*arrays)

    def _run(self, x, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, expert_map, *,
             activation, weight_on_input, float_tokens=False):  # fmt: skip
        weights = ExpertWeights(w1=w1, w2=w2, w1_scale=w1_scale, w2_scale=w2_scale)
        quant_config = quant.Fp8BlockQuant() if weights.is_fp8 else None
        prepared = self.prepare_finalize.prepare(
            x,
            topk_weights,
            topk_ids,
            quant_config=None if float_tokens else quant_config,
            apply_router_weight_on_input=weight_on_input,
        )
        call = ExpertsCall(activation=activation, quant_config=quant_config, out_dtype=x.dtype)
        expert_output = self._run_experts(prepared, weights, expert_map=expert_map, call=call)
        out = self.prepare_finalize.finalize(
            expert_output, prepared, self.experts.weight_and_reduce(), out_dtype=x.dtype
        )
        return out, dataclasses.replace(prepared, x=None, x_scales=None)

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


_FROZEN = (None, "w1", "w2", None, None, "w1_scale", "w2_scale", None)  # `_run`'s arrays


def _frozen_fp8(run, refusal: str | None):
    """`run(*arrays)` with FP8 weights held constant (`ModularMoE.forward`): as it is when not
    differentiated; under differentiation `run(..., float_tokens=True)`, whose float rows the
    experts' GEMMs quantize inside their VJPs; a gradient to a weight or scale raises, and a
    prepare's `gradient_refusal` (one JAX cannot differentiate) raises as it is."""

    @jax.custom_vjp
    def call(*arrays):
        return run(*arrays)

    def fwd(*primals):
        if refusal is not None:
            raise TypeError(refusal)
        x, w1, w2, weights, ids, s1, s2, expert_map = primal_values(primals, _FROZEN)

        def run_float(x, weights):
            return run(x, w1, w2, weights, ids, s1, s2, expert_map, float_tokens=True)

        out, vjp, prepared = jax.vjp(run_float, x, weights, has_aux=True)
        return (out, prepared), vjp

    def bwd(vjp, g):
        dx, dweights = vjp(instantiate(g[0]))
        return dx, None, None, dweights, None, None, None, None

    call.defvjp(fwd, bwd, symbolic_zeros=True)
    return call
