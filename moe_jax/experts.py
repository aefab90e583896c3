"""Experts: the vocabulary the two expert layouts share.

Experts run permute -> GEMM1 -> act(gate) * up (-> requantize) -> GEMM2 -> weight-and-reduce in
one of two layouts, each an object holding its choices (vLLM's FusedMoEPermuteExpertsUnpermute):

- `moe_jax.contiguous_experts.ContiguousExperts`: expert-major rows padded per expert (DeepGEMM
  contiguous, torch grouped GEMM); the gather at the end applies the router weights and sums the
  slots.
- `moe_jax.masked_experts.MaskedExperts`: `[E, max_m, H]` blocks (DeepGEMM masked; the layout
  DeepEP low-latency delivers).

`moe_jax.experts_by_name` names them for `fused_moe(experts=...)`. This module holds what both
use: the weights (`ExpertWeights`), the per-call choices (`ExpertsCall`), the static facts of a
call (`ExpertsProblem`, which `moe_jax.plan` plans from), the `Experts` base class and the
activation between the GEMMs (`activate`).

Both return the reduced `[T, H]` output, so their `weight_and_reduce()` is `AlreadyReduced`.
Numerics follow vLLM's canonical FP8 pipeline: quantized x -> GEMM1 -> bf16 [*, 2I] -> act*up in
bf16 -> per-token-group quantization -> GEMM2 -> bf16 [*, H] -> float32 weighted sum -> out dtype.

Every stage is differentiable with float weights, whatever backend runs it (custom VJPs in
`moe_jax.permute` and `moe_jax.grouped_gemm_backward`); `ContiguousExperts(recipe=Fp8Training())`
trains float master weights through FP8 GEMMs (`moe_jax.fp8_training`). Pre-quantized FP8 weights
are held constant: gradients reach the tokens and routing weights, never the float8 weights.
"""

from __future__ import annotations

import abc
import dataclasses
import math

import jax
import jax.numpy as jnp

from moe_jax import act_quant, quant
from moe_jax._pytree import pytree_dataclass
from moe_jax.activation import act_and_mul
from moe_jax.prepare_finalize import (
    ActivationFormat,
    AlreadyReduced,
    PreparedTokens,
    WeightAndReduce,
)
from moe_jax.registry import current_platform


@pytree_dataclass
class ExpertWeights:
    """Expert MLP weights in vLLM's layout.

    Attributes:
      w1: [E, 2I, H] gate rows [0, I), then up rows [I, 2I); float or float8_e4m3fn.
      w2: [E, H, I].
      w1_scale: float32[E, ceil(2I/128), ceil(H/128)] for FP8 w1, else None.
      w2_scale: float32[E, ceil(H/128), ceil(I/128)] for FP8 w2, else None.
    """

    w1: jax.Array
    w2: jax.Array
    w1_scale: jax.Array | None = None
    w2_scale: jax.Array | None = None

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def is_fp8(self) -> bool:
        return self.w1.dtype == quant.FP8_DTYPE


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertsCall:
    """Per-call static choices the experts need besides tensors."""

    activation: str = "silu"
    quant_config: quant.Fp8BlockQuant | None = None
    out_dtype: jnp.dtype = jnp.bfloat16


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertsProblem:
    """Static facts of one experts call (one chunk under chunking), for `unsupported_reason`.

    Attributes:
      num_tokens: T, tokens the experts get.
      topk: k, slots per token.
      num_experts: E, local experts.
      hidden: H.
      intermediate: I.
      x_dtype: name of the rows' dtype ("float8_e4m3fn" when prepare quantized them).
      mid_dtype: name of the GEMM outputs' dtype (`intermediate_dtype`).
      group_size: columns per float32 activation scale on the FP8 path, else None.
      weight_bytes: bytes of the E experts' w1, w2 and block scales (all a call can read of
        them; a decode step from T=128 on reads nearly all of DeepSeek-V3's 256 experts).
      w_dtype: name of the weights' dtype (None: x_dtype's).
      activation: the gated activation.
      platform: where the call runs ("cpu", "gpu", ...; `moe_jax.registry.current_platform`).
    """

    num_tokens: int
    topk: int
    num_experts: int
    hidden: int
    intermediate: int
    x_dtype: str
    mid_dtype: str
    group_size: int | None
    weight_bytes: int
    w_dtype: str | None = None
    activation: str = "silu"
    platform: str = "cpu"

    @classmethod
    def of(
        cls, prepared: PreparedTokens, weights: ExpertWeights, call: ExpertsCall
    ) -> ExpertsProblem:
        """The problem of one `Experts.apply` call: its tokens' shapes, the weights' dtypes and
        sizes, and the call's activation and quantization."""
        num_tokens, topk = prepared.topk_ids.shape
        arrays = (weights.w1, weights.w2, weights.w1_scale, weights.w2_scale)
        return cls(
            num_tokens=num_tokens,
            topk=topk,
            num_experts=weights.num_experts,
            hidden=weights.w1.shape[2],
            intermediate=weights.w2.shape[2],
            x_dtype=jnp.dtype(prepared.x.dtype).name,
            mid_dtype=jnp.dtype(intermediate_dtype(prepared.x.dtype, call)).name,
            group_size=None if call.quant_config is None else call.quant_config.group_size,
            weight_bytes=sum(_nbytes(a) for a in arrays if a is not None),
            w_dtype=jnp.dtype(weights.w1.dtype).name,
            activation=call.activation,
            platform=current_platform(),
        )

    @property
    def weight_dtype(self) -> str:
        return self.x_dtype if self.w_dtype is None else self.w_dtype

    @property
    def row_bytes(self) -> int:
        """Bytes one row of a layout carries through the MLP: the token (H, plus its scales on
        the FP8 path), GEMM1's output (2I), the activation (I, FP8 plus scales when requantized)
        and GEMM2's output (H)."""
        h, i = self.hidden, self.intermediate
        mid = jnp.dtype(self.mid_dtype).itemsize
        x_bytes = h * jnp.dtype(self.x_dtype).itemsize
        act_bytes = i * mid
        if self.group_size is not None:  # FP8 rows and activations carry float32 group scales
            x_bytes += -(-h // self.group_size) * 4
            act_bytes = i + -(-i // self.group_size) * 4
        return x_bytes + 2 * i * mid + act_bytes + h * mid


def _nbytes(a) -> int:
    return math.prod(a.shape) * jnp.dtype(a.dtype).itemsize


class Experts(abc.ABC):
    """Runs the local experts on prepared tokens.

    Like every implementation in `moe_jax.registry`, an `Experts` has a `name` and says why it
    cannot run a problem (`unsupported_reason`, None when it runs); where it refuses, `apply`
    raises a `NoImplementationError` carrying that reason (`MaskedExperts`' capacity).
    `activation_formats`: the formats of prepared tokens it consumes (`ModularMoE` checks).
    """

    activation_formats = (ActivationFormat.STANDARD,)

    @property
    def name(self) -> str:
        return type(self).__name__

    def unsupported_reason(self, problem: ExpertsProblem) -> str | None:
        """None if these experts run `problem`, else why not. The GEMM backends are chosen (and
        may refuse) by the call's plan (`moe_jax.plan`)."""
        del problem
        return None

    @abc.abstractmethod
    def apply(
        self,
        prepared: PreparedTokens,
        weights: ExpertWeights,
        *,
        expert_map: jax.Array | None,
        call: ExpertsCall,
    ) -> jax.Array:
        """PreparedTokens with T tokens -> expert output (see `weight_and_reduce`)."""

    def weight_and_reduce(self) -> WeightAndReduce:
        """What `finalize` applies to `apply`'s output: here nothing (`AlreadyReduced`), as
        these experts weight and sum each token's rows themselves."""
        return AlreadyReduced()


def intermediate_dtype(x_dtype, call: ExpertsCall):
    """GEMM outputs are bf16 on the FP8 path (DeepGEMM's D), else the activation dtype."""
    return jnp.bfloat16 if call.quant_config is not None else x_dtype


def activate(
    h: jax.Array,
    call: ExpertsCall,
    *,
    impl: str = "auto",
    expert_ids: jax.Array | None = None,
    is_scales_group_major: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """act(gate) * up of GEMM1's output [M, 2I], requantized for GEMM2 on the FP8 path.

    Args:
      expert_ids: optional int32[M], the layout's expert per row (-1 on padding). On the float
        path padding rows come out as zeros (GEMM1 may leave garbage there, and the weight
        gradient sums whole segments); the FP8 path (inference) leaves them unspecified and
        may skip computing them: GEMM2's output on padding rows is never read.
      is_scales_group_major: GEMM2 reads the FP8 scales through their transpose
        (`GroupedGemm.is_scales_group_major`): the kernel writes them so.

    Returns:
      ([M, I] in h's dtype, None) without quantization; (float8_e4m3fn[M, I], float32[M, I/128])
      on the FP8 path, through `moe_jax.act_quant.act_and_quant(impl=impl)`.
    """
    if call.quant_config is None:
        row_mask = None if expert_ids is None else expert_ids >= 0
        return act_and_mul(h, call.activation, row_mask=row_mask), None
    return act_quant.act_and_quant(
        h,
        activation=call.activation,
        group_size=call.quant_config.group_size,
        impl=impl,
        expert_ids=expert_ids,
        is_scales_group_major=is_scales_group_major,
    )
