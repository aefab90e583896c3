"""Experts: permute -> GEMM1 -> act(gate) * up (-> requantize) -> GEMM2 -> weight-and-reduce.

Two layouts, each an object holding its choices (vLLM's FusedMoEPermuteExpertsUnpermute):

- `ContiguousExperts`: expert-major rows padded per expert (DeepGEMM contiguous, torch grouped
  GEMM); the gather at the end applies the router weights and sums the slots.
- `MaskedExperts`: `[E, max_m, H]` blocks (DeepGEMM masked; the layout DeepEP low-latency delivers).

Both return the reduced `[T, H]` output, so their `weight_and_reduce()` is `AlreadyReduced`.
Numerics follow vLLM's canonical FP8 pipeline: quantized x -> GEMM1 -> bf16 [*, 2I] -> act*up in
bf16 -> per-token-group quantization -> GEMM2 -> bf16 [*, H] -> float32 weighted sum -> out dtype.
"""

from __future__ import annotations

import abc
import dataclasses

import jax
import jax.numpy as jnp

from moe_jax import grouped_gemm, layouts, permute, quant
from moe_jax._pytree import pytree_dataclass
from moe_jax.activation import act_and_mul
from moe_jax.prepare_finalize import AlreadyReduced, PreparedTokens, WeightAndReduce


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


class Experts(abc.ABC):
    """Runs the local experts on prepared tokens."""

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
        return AlreadyReduced()


def select_gemms(
    gemm: str | grouped_gemm.GroupedGemm | None,
    weights: ExpertWeights,
    *,
    layout: str,
    num_rows: int,
    x_dtype,
    alignment: int = 1,
) -> tuple[grouped_gemm.GroupedGemm, grouped_gemm.GroupedGemm]:
    """The backends that run GEMM1 ([rows, H] x w1) and GEMM2 ([rows, I] x w2) for `gemm`."""
    common = dict(
        layout=layout,
        num_rows=num_rows,
        num_groups=weights.num_experts,
        w_dtype=jnp.dtype(weights.w1.dtype).name,
        x_dtype=jnp.dtype(x_dtype).name,
        alignment=alignment,
        platform=jax.default_backend(),
    )
    return tuple(
        grouped_gemm.select_gemm(
            gemm, grouped_gemm.GemmProblem(n=w.shape[1], k=w.shape[2], **common)
        )
        for w in (weights.w1, weights.w2)
    )


def _intermediate_dtype(prepared: PreparedTokens, call: ExpertsCall):
    """GEMM outputs are bf16 on the FP8 path (DeepGEMM's D), else the activation dtype."""
    return jnp.bfloat16 if call.quant_config is not None else prepared.x.dtype


def _activate(
    h: jax.Array, call: ExpertsCall, impl: str | None = "xla"
) -> tuple[jax.Array, jax.Array | None]:
    """act(gate) * up, requantized for GEMM2 on the FP8 path.

    impl: as `moe_jax.permute`'s; "pallas"/"pallas_interpret" run the fused activation +
    quantization kernel (`moe_jax.kernels.act_and_quant`) on the FP8 path; activations its
    compiled form lacks (gelu) take the XLA path on the GPU.
    """
    if call.quant_config is None:
        return act_and_mul(h, call.activation), None
    impl = permute.resolve_impl(impl)
    if impl == "pallas":
        from moe_jax.kernels.act_quant import COMPILED_ACTIVATIONS

        impl = impl if call.activation in COMPILED_ACTIVATIONS else "xla"
    if impl == "xla":
        return call.quant_config.quantize_activations(act_and_mul(h, call.activation))
    from moe_jax import kernels

    return kernels.act_and_quant(
        h,
        activation=call.activation,
        group_size=call.quant_config.group_size,
        interpret=impl == "pallas_interpret",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContiguousExperts(Experts):
    """Experts on the contiguous layout.

    Attributes:
      gemm: GEMM backend name ("xla", "torch", "deep_gemm"), a `GroupedGemm`, or None for the best
        that runs.
      permute_impl: "xla", "pallas", "pallas_interpret", or None (Pallas on GPU, XLA elsewhere)
        for the permute and the weighted gather.
      act_quant_impl: the same choice for act(gate) * up + FP8 requantization (FP8 path only).
      alignment: rows per expert segment multiple (DeepGEMM needs 128).
    """

    gemm: str | grouped_gemm.GroupedGemm | None = "xla"
    permute_impl: str | None = None
    act_quant_impl: str | None = None
    alignment: int = layouts.DEFAULT_ALIGNMENT

    def select_gemms(self, weights: ExpertWeights, *, num_tokens: int, topk: int, x_dtype):
        num_rows = layouts.contiguous_num_rows(
            num_tokens, topk, weights.num_experts, self.alignment
        )
        return select_gemms(
            self.gemm,
            weights,
            layout="contiguous",
            num_rows=num_rows,
            x_dtype=x_dtype,
            alignment=self.alignment,
        )

    def apply(self, prepared, weights, *, expert_map, call):
        num_tokens, topk = prepared.topk_ids.shape
        gemm1, gemm2 = self.select_gemms(
            weights, num_tokens=num_tokens, topk=topk, x_dtype=prepared.x.dtype
        )
        mid_dtype = _intermediate_dtype(prepared, call)
        lay = permute.permute(
            prepared.x,
            prepared.topk_ids,
            num_experts=weights.num_experts,
            x_scales=prepared.x_scales,
            expert_map=expert_map,
            alignment=self.alignment,
            impl=self.permute_impl,
        )
        h = gemm1.contiguous(
            lay.rows,
            weights.w1,
            lay.expert_ids,
            lay.expert_ends,
            x_scales=lay.row_scales,
            w_scales=weights.w1_scale,
            alignment=self.alignment,
            out_dtype=mid_dtype,
        )
        a, a_scales = _activate(h, call, self.act_quant_impl)
        y = gemm2.contiguous(
            a,
            weights.w2,
            lay.expert_ids,
            lay.expert_ends,
            x_scales=a_scales,
            w_scales=weights.w2_scale,
            alignment=self.alignment,
            out_dtype=mid_dtype,
        )
        return permute.unpermute(
            y, lay.inverse, prepared.topk_weights, out_dtype=call.out_dtype, impl=self.permute_impl
        )


def masked_mlp(
    rows: jax.Array,
    row_scales: jax.Array | None,
    num_rows_per_expert: jax.Array,
    weights: ExpertWeights,
    *,
    gemm: str | grouped_gemm.GroupedGemm | None,
    call: ExpertsCall,
    expected_m: int | None = None,
) -> jax.Array:
    """The expert MLP on masked blocks: GEMM1 -> act(gate) * up (-> requantize) -> GEMM2.

    Args:
      rows: [E, max_m, H] activations (FP8 with `row_scales` float32[E, max_m, H // 128] on the
        FP8 path); rows at or past `num_rows_per_expert[e]` are ignored.
      num_rows_per_expert: int32[E] valid rows (DeepGEMM's masked_m).
      gemm: GEMM backend name or object.
      expected_m: scheduling hint for tuned backends; None means max_m.

    Returns:
      [E, max_m, H] in the intermediate dtype (bf16 on the FP8 path); rows past the counts are
      unspecified.
    """
    max_m = rows.shape[1]
    gemm1, gemm2 = select_gemms(gemm, weights, layout="masked", num_rows=max_m, x_dtype=rows.dtype)
    mid_dtype = jnp.bfloat16 if call.quant_config is not None else rows.dtype
    expected_m = max_m if expected_m is None else expected_m
    h = gemm1.masked(
        rows,
        weights.w1,
        num_rows_per_expert,
        x_scales=row_scales,
        w_scales=weights.w1_scale,
        expected_m=expected_m,
        out_dtype=mid_dtype,
    )
    a, a_scales = _activate(h, call)
    return gemm2.masked(
        a,
        weights.w2,
        num_rows_per_expert,
        x_scales=a_scales,
        w_scales=weights.w2_scale,
        expected_m=expected_m,
        out_dtype=mid_dtype,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaskedExperts(Experts):
    """Experts on the masked layout `[E, max_m, H]`.

    Attributes:
      gemm: as for `ContiguousExperts`.
      max_m: rows per expert; None means T * k, which never drops a pair. A smaller value drops
        the pairs that do not fit (in (token, slot) order), so use it only when the routing is
        known to fit (e.g. DeepEP's per-rank token limit).
    """

    gemm: str | grouped_gemm.GroupedGemm | None = "xla"
    max_m: int | None = None

    def apply(self, prepared, weights, *, expert_map, call):
        num_tokens, topk = prepared.topk_ids.shape
        max_m = num_tokens * topk if self.max_m is None else self.max_m
        lay = layouts.masked_layout_reference(
            prepared.x,
            prepared.topk_ids,
            num_experts=weights.num_experts,
            max_m=max_m,
            x_scales=prepared.x_scales,
            expert_map=expert_map,
        )
        # DeepGEMM's scheduling hint: the mean rows per expert, rounded up to 16 (vLLM's choice).
        expected_m = max(
            16, min(max_m, layouts.round_up(-(-num_tokens * topk // weights.num_experts), 16))
        )
        y = masked_mlp(
            lay.rows,
            lay.row_scales,
            lay.num_tokens_per_expert,
            weights,
            gemm=self.gemm,
            call=call,
            expected_m=expected_m,
        )
        flat = y.reshape(-1, y.shape[-1])
        return layouts.unpermute_reference(
            flat, lay.inverse, prepared.topk_weights, out_dtype=call.out_dtype
        )


# Names accepted by `fused_moe(experts=...)`; "auto" is resolved by `resolve_experts`.
_NAMED_EXPERTS = {
    "xla": lambda: ContiguousExperts(gemm="xla", permute_impl="xla", act_quant_impl="xla"),
    "torch": lambda: ContiguousExperts(gemm="torch"),
    "mosaic": lambda: ContiguousExperts(gemm="mosaic"),
    "deep_gemm": lambda: ContiguousExperts(gemm="deep_gemm"),
    "xla_masked": lambda: MaskedExperts(gemm="xla"),
    "deep_gemm_masked": lambda: MaskedExperts(gemm="deep_gemm"),
}
EXPERTS_NAMES = ("auto", *_NAMED_EXPERTS)


def resolve_experts(
    experts: str | Experts, weights: ExpertWeights, *, num_tokens: int, topk: int, x_dtype
) -> Experts:
    """An `Experts` object from a name; "auto" picks the fastest that runs here.

    "auto" is the XLA reference off the GPU. On a GPU it is the contiguous layout with the first
    GEMM backend in `grouped_gemm.PREFERENCE` that accepts both GEMMs (DeepGEMM, then torch),
    and the Pallas permute kernels.
    """
    if isinstance(experts, Experts):
        return experts
    if experts not in EXPERTS_NAMES:
        raise ValueError(
            f"unknown experts {experts!r}; choose from {list(EXPERTS_NAMES)} "
            "or pass an Experts object"
        )
    if experts != "auto":
        return _NAMED_EXPERTS[experts]()
    if jax.default_backend() == "cpu":
        return _NAMED_EXPERTS["xla"]()
    for name in grouped_gemm.PREFERENCE:
        candidate = ContiguousExperts(gemm=name)
        try:
            candidate.select_gemms(weights, num_tokens=num_tokens, topk=topk, x_dtype=x_dtype)
        except NotImplementedError:
            continue
        return candidate
    return _NAMED_EXPERTS["xla"]()
