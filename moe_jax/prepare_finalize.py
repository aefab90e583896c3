"""PrepareAndFinalize and TopKWeightAndReduce: what happens before and after the experts.

`prepare` turns routed tokens into what the experts consume (here: optional router-weight-on-input
scaling and FP8 quantization; expert-parallel variants also dispatch). `finalize` turns the experts'
output back into `[T, H]`, applying a `WeightAndReduce` object the experts choose (vLLM's split).
"""

from __future__ import annotations

import abc
import dataclasses

import jax
import jax.numpy as jnp

from moe_jax import act_quant, layouts, quant
from moe_jax._pytree import pytree_dataclass


@pytree_dataclass
class PreparedTokens:
    """Tokens as the experts will see them.

    Attributes:
      x: [T, H] activations: the hidden dtype, or float8_e4m3fn when quantized.
      x_scales: float32[T, H // 128] per-token-group scales of FP8 `x`, else None.
      topk_ids: int32[T, k] expert ids (global; experts apply the expert_map).
      topk_weights: float32[T, k] weights still to apply (ones after weight-on-input).
    """

    x: jax.Array
    x_scales: jax.Array | None
    topk_ids: jax.Array
    topk_weights: jax.Array


class WeightAndReduce(abc.ABC):
    """Turns the experts' output into [T, H] (vLLM's TopKWeightAndReduce)."""

    @abc.abstractmethod
    def apply(self, expert_output: jax.Array, topk_weights: jax.Array, *, out_dtype) -> jax.Array:
        """expert_output as the experts returned it -> [T, H] in out_dtype."""


@dataclasses.dataclass(frozen=True)
class AlreadyReduced(WeightAndReduce):
    """The experts weighted and summed already (contiguous and masked experts here)."""

    def apply(self, expert_output, topk_weights, *, out_dtype):
        del topk_weights
        return expert_output.astype(out_dtype)


class PrepareFinalize(abc.ABC):
    """Before and after the experts: `NoEPPrepareFinalize`; expert-parallel variants dispatch."""

    @abc.abstractmethod
    def prepare(
        self,
        hidden_states: jax.Array,
        topk_weights: jax.Array,
        topk_ids: jax.Array,
        *,
        quant_config: quant.Fp8BlockQuant | None,
        apply_router_weight_on_input: bool,
    ) -> PreparedTokens:
        """[T, H] tokens and their routing -> `PreparedTokens`."""

    @abc.abstractmethod
    def finalize(
        self,
        expert_output: jax.Array,
        prepared: PreparedTokens,
        weight_and_reduce: WeightAndReduce,
        *,
        out_dtype,
    ) -> jax.Array:
        """The experts' output -> [T, H] in out_dtype."""


def scale_by_router_weight(hidden_states: jax.Array, topk_weights: jax.Array) -> jax.Array:
    """x * w for top-1 routing (`apply_router_weight_on_input`), computed in float32."""
    scaled = hidden_states.astype(jnp.float32) * topk_weights.astype(jnp.float32)
    return scaled.astype(hidden_states.dtype)


@dataclasses.dataclass(frozen=True)
class NoEPPrepareFinalize(PrepareFinalize):
    """No expert parallelism: every expert is local; prepare only scales and quantizes.

    Attributes:
      quant_impl: implementation of the FP8 token quantization (`moe_jax.act_quant.group_quant`):
        "auto", "xla", "pallas", "pallas_interpret" or an implementation object.
    """

    quant_impl: str = "auto"

    def prepare(
        self, hidden_states, topk_weights, topk_ids, *, quant_config, apply_router_weight_on_input
    ):
        weights = topk_weights.astype(jnp.float32)
        x = hidden_states
        if apply_router_weight_on_input:
            x = scale_by_router_weight(x, weights)
            weights = jnp.ones_like(weights)
        x_scales = None
        if quant_config is not None:
            x, x_scales = act_quant.group_quant(
                x, group_size=quant_config.group_size, impl=self.quant_impl
            )
        return PreparedTokens(
            x=x, x_scales=x_scales, topk_ids=layouts.ids_as_int32(topk_ids), topk_weights=weights
        )

    def finalize(self, expert_output, prepared, weight_and_reduce, *, out_dtype):
        return weight_and_reduce.apply(expert_output, prepared.topk_weights, out_dtype=out_dtype)
