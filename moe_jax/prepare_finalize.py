"""PrepareAndFinalize and TopKWeightAndReduce: what happens before and after the experts.

`prepare` turns routed tokens into what the experts consume (here: optional router-weight-on-input
scaling and FP8 quantization; expert-parallel variants also dispatch). `finalize` turns the experts'
output back into `[T, H]`, applying a `WeightAndReduce` object the experts choose (vLLM's split).
A `PrepareFinalize` delivers one `ActivationFormat` (token rows, or the masked per-expert blocks of
DeepEP low latency and `MaskedPrepareFinalize`); `ModularMoE` checks the experts consume it.
"""

from __future__ import annotations

import abc
import dataclasses
import enum

import jax
import jax.numpy as jnp

from moe_jax import act_quant, layouts, quant
from moe_jax._pytree import pytree_dataclass


class ActivationFormat(enum.Enum):
    """How prepared tokens are laid out (vLLM's `FusedMoEActivationFormat`)."""

    STANDARD = "standard"  # [T, H] token rows with their [T, k] routing: `PreparedTokens`
    MASKED = "masked"  # [E_local, max_m, H] per-expert blocks and counts: `MaskedTokens`


@pytree_dataclass
class PreparedTokens:
    """Tokens as the experts will see them, in the standard format (token rows).

    Attributes:
      x: [T, H] activations: the hidden dtype, or float8_e4m3fn when quantized.
      x_scales: float32[T, H // 128] per-token-group scales of FP8 `x`, else None.
      topk_ids: int32[T, k] expert ids (global; experts apply the expert_map).
      topk_weights: float32[T, k] weights still to apply (ones after weight-on-input).
    """

    activation_format = ActivationFormat.STANDARD
    x: jax.Array
    x_scales: jax.Array | None
    topk_ids: jax.Array
    topk_weights: jax.Array


@pytree_dataclass
class MaskedTokens(PreparedTokens):
    """Tokens in the masked format: block e holds the rows routed to local expert e.

    Attributes:
      x: [E_local, max_m, H] blocks (FP8 with x_scales float32[E_local, max_m, H // 128]); rows
        at or past num_tokens_per_expert[e] are unspecified (DeepEP leaves them stale).
      topk_ids, topk_weights: the [T, k] routing given to `prepare`; the experts return unweighted
        blocks, and `finalize` applies these weights (as DeepEP's low-latency combine does).
      num_tokens_per_expert: int32[E_local] valid rows per block (DeepGEMM's masked_m).
    """

    activation_format = ActivationFormat.MASKED
    num_tokens_per_expert: jax.Array


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
    """Before and after the experts: `NoEPPrepareFinalize`; expert-parallel variants dispatch.

    `activation_format` is the format `prepare` delivers (`MaskedTokens` for MASKED); a
    masked-format `finalize` weights and sums the blocks itself and ignores `weight_and_reduce`.
    `gradient_refusal`: None, or the TypeError message `ModularMoE` raises under
    differentiation (a prepare whose exchange JAX cannot differentiate).
    """

    activation_format = ActivationFormat.STANDARD
    gradient_refusal = None

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
        "auto", "xla", "pallas" or an implementation object.
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


@pytree_dataclass
class LocalMaskedTokens(MaskedTokens):
    """`MaskedTokens` with `inverse`: int32[T, k] flat row of each (token, slot), -1 for none
    (`layouts.MaskedLayout.inverse`)."""

    inverse: jax.Array


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class MaskedPrepareFinalize(PrepareFinalize):
    """The masked format in pure JAX: DeepEP low latency's layout on one rank (vLLM's
    BatchedPrepareAndFinalize). `MaskedExperts` uses it on [T, H] tokens; CPU tests use it.

    `prepare` scales and quantizes as `NoEPPrepareFinalize`, then copies each token into the block
    of each local expert it picks, in token order (a token repeating an expert takes one row);
    `finalize` sums each token's rows times its weights in float32.

    Attributes:
      num_experts: E_local, the number of blocks.
      max_m: rows per block; None means T, which never drops. A smaller value drops the (token,
        expert) rows past it, in token order.
      expert_map: int[E_global] global -> local expert (-1: not here), or None: ids outside
        [0, num_experts) go nowhere.
      quant_impl: as `NoEPPrepareFinalize`.

    Example:
      >>> pf = MaskedPrepareFinalize(num_experts=2)
      >>> ids = jnp.array([[1, 1], [0, -1], [1, 0]])
      >>> tokens = pf.prepare(jnp.ones((3, 4)), jnp.ones((3, 2)), ids,
      ...                     quant_config=None, apply_router_weight_on_input=False)
      >>> tokens.x.shape, tokens.num_tokens_per_expert.tolist(), tokens.inverse.tolist()
      ((2, 3, 4), [2, 2], [[3, 3], [0, -1], [4, 1]])
    """

    activation_format = ActivationFormat.MASKED
    num_experts: int
    max_m: int | None = None
    expert_map: jax.Array | None = None
    quant_impl: str = "auto"

    def prepare(
        self, hidden_states, topk_weights, topk_ids, *, quant_config, apply_router_weight_on_input
    ):
        tokens = NoEPPrepareFinalize(self.quant_impl).prepare(
            hidden_states,
            topk_weights,
            topk_ids,
            quant_config=quant_config,
            apply_router_weight_on_input=apply_router_weight_on_input,
        )
        return self.blocks(tokens)

    def blocks(self, tokens: PreparedTokens) -> LocalMaskedTokens:
        """Standard-format tokens -> their blocks (`layouts.masked_layout_reference`)."""
        max_m = max(tokens.x.shape[0], 1) if self.max_m is None else self.max_m
        lay = layouts.masked_layout_reference(
            tokens.x,
            tokens.topk_ids,
            num_experts=self.num_experts,
            max_m=max_m,
            x_scales=tokens.x_scales,
            expert_map=self.expert_map,
        )
        return LocalMaskedTokens(
            x=lay.rows,
            x_scales=lay.row_scales,
            topk_ids=tokens.topk_ids,
            topk_weights=tokens.topk_weights,
            num_tokens_per_expert=lay.num_tokens_per_expert,
            inverse=lay.inverse,
        )

    def finalize(self, expert_output, prepared, weight_and_reduce, *, out_dtype):
        del weight_and_reduce  # the masked format's finalize weights (class docstring)
        flat = expert_output.reshape(-1, expert_output.shape[-1])
        return layouts.unpermute_reference(
            flat, prepared.inverse, prepared.topk_weights, out_dtype=out_dtype
        )
