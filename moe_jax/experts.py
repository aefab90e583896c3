"""Experts: permute -> GEMM1 -> act(gate) * up (-> requantize) -> GEMM2 -> weight-and-reduce.

Two layouts, each an object holding its choices (vLLM's FusedMoEPermuteExpertsUnpermute):

- `ContiguousExperts`: expert-major rows padded per expert (DeepGEMM contiguous, torch grouped
  GEMM); the gather at the end applies the router weights and sums the slots.
- `MaskedExperts`: `[E, max_m, H]` blocks (DeepGEMM masked; the layout DeepEP low-latency delivers).

Both return the reduced `[T, H]` output, so their `weight_and_reduce()` is `AlreadyReduced`.
Numerics follow vLLM's canonical FP8 pipeline: quantized x -> GEMM1 -> bf16 [*, 2I] -> act*up in
bf16 -> per-token-group quantization -> GEMM2 -> bf16 [*, H] -> float32 weighted sum -> out dtype.

Every stage is differentiable with float weights, whatever backend runs it (custom VJPs in
`moe_jax.permute` and `moe_jax.grouped_gemm_backward`); `ContiguousExperts(recipe=Fp8Training())`
trains float master weights through FP8 GEMMs (`moe_jax.fp8_training`). Pre-quantized FP8 weights
are inference-only.
"""

from __future__ import annotations

import abc
import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moe_jax import act_quant, fp8_training, grouped_gemm, layouts, permute, quant
from moe_jax._pytree import pytree_dataclass
from moe_jax.activation import act_and_mul
from moe_jax.grouped_gemm_backward import grouped_gemm_contiguous, grouped_gemm_masked
from moe_jax.prepare_finalize import AlreadyReduced, PreparedTokens, WeightAndReduce
from moe_jax.registry import NoImplementationError, current_platform


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

    @classmethod
    def of(
        cls, prepared: PreparedTokens, weights: ExpertWeights, call: ExpertsCall
    ) -> ExpertsProblem:
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
        )

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
    """

    @property
    def name(self) -> str:
        return type(self).__name__

    def unsupported_reason(self, problem: ExpertsProblem) -> str | None:
        """None if these experts run `problem`, else why not. The GEMM backends are chosen (and
        may refuse) inside `apply`, through `moe_jax.grouped_gemm.GEMMS`."""
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
        return AlreadyReduced()


@dataclasses.dataclass(frozen=True)
class GemmPair:
    """The backends of the two GEMMs and the contiguous layout's segment multiple.

    With `fuses_act_quant`, `gemm1` runs GEMM1, act(gate) * up and the FP8 quantization as one
    kernel (its `contiguous_act_quant` method).
    """

    gemm1: grouped_gemm.GroupedGemm
    gemm2: grouped_gemm.GroupedGemm
    alignment: int | None
    fuses_act_quant: bool = False


def select_gemms(
    gemm: str | grouped_gemm.GroupedGemm,
    weights: ExpertWeights,
    *,
    layout: str,
    num_pairs: int,
    x_dtype,
    alignment: int | None = None,
    max_m: int | None = None,
    fused_act_quant: str | grouped_gemm.GroupedGemm | None = None,
) -> GemmPair:
    """The backends for GEMM1 ([rows, H] x w1) and GEMM2 ([rows, I] x w2), through the registry.

    On the contiguous layout with `alignment=None`, GEMM1's backend sets the segment multiple
    (`GroupedGemm.layout_alignment`) and GEMM2 must accept it too ("auto" moves on to a backend
    that does). `fused_act_quant` names a backend that then runs GEMM1 with act(gate) * up and
    the FP8 quantization fused (`GroupedGemm` with a `contiguous_act_quant` method), on the
    segment multiple `gemm` chose.
    """

    def problem(w: jax.Array, align: int | None) -> grouped_gemm.GemmProblem:
        return grouped_gemm.GemmProblem(
            layout=layout,
            n=w.shape[1],
            k=w.shape[2],
            num_experts=weights.num_experts,
            num_pairs=num_pairs,
            x_dtype=jnp.dtype(x_dtype).name,
            w_dtype=jnp.dtype(weights.w1.dtype).name,
            platform=current_platform(),
            alignment=align,
            max_m=max_m,
        )

    gemm1_problem = problem(weights.w1, alignment)
    gemm1 = grouped_gemm.GEMMS.select(gemm, gemm1_problem)
    if layout == "contiguous" and alignment is None:
        alignment = gemm1.layout_alignment(gemm1_problem)
    gemm2 = grouped_gemm.GEMMS.select(gemm, problem(weights.w2, alignment))
    if fused_act_quant is None:
        return GemmPair(gemm1=gemm1, gemm2=gemm2, alignment=alignment)
    fused = grouped_gemm.GEMMS.select(fused_act_quant, problem(weights.w1, alignment))
    if layout != "contiguous" or not callable(getattr(fused, "contiguous_act_quant", None)):
        raise ValueError(
            f"fused_act_quant={fused_act_quant!r}: the backend has no GEMM1 with a fused act + "
            f"quantization on the {layout} layout; choose one of "
            f"{list(FUSED_ACT_QUANT_GEMMS)} (contiguous layout)"
        )
    return GemmPair(gemm1=fused, gemm2=gemm2, alignment=alignment, fuses_act_quant=True)


# GEMM backends with a `contiguous_act_quant` method (GEMM1 + act(gate) * up + FP8 quantization
# in one kernel), for `ContiguousExperts(fused_act_quant=...)`.
FUSED_ACT_QUANT_GEMMS = ("mosaic_fp8", "mosaic_fp8_interpret")


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


RESIDUAL_LAYOUT = "moe_layout"
RESIDUAL_GEMM1 = "moe_gemm1_out"
RESIDUAL_GEMM2 = "moe_gemm2_out"
RECOMPUTE_POLICIES: dict[str, tuple[str, ...] | None] = {
    "none": None,  # no jax.checkpoint: every residual is kept
    "activation": (RESIDUAL_LAYOUT, RESIDUAL_GEMM1, RESIDUAL_GEMM2),
    "gemm2": (RESIDUAL_LAYOUT, RESIDUAL_GEMM1),
    "all": (),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContiguousExperts(Experts):
    """Experts on the contiguous layout: permute -> GEMM1 -> act (+quant) -> GEMM2 -> unpermute.

    Each stage is a public method, so profiles and benchmarks time the same code that `apply`
    runs. Every choice goes through `moe_jax.registry`; "auto" is the fastest that runs here.

    Attributes:
      gemm: GEMM backend name, a `GroupedGemm`, or "auto".
      permute_impl: implementation of the permute and of the weighted gather (`moe_jax.permute`).
      act_quant_impl: implementation of act(gate) * up + FP8 requantization (`moe_jax.act_quant`).
      alignment: rows per expert segment multiple; None takes GEMM1's backend's own for the
        call (DeepGEMM needs 128; the Pallas GEMM takes 16, 32 or 64 by rows per expert).
      wgrad: implementation of the grouped weight gradient in the backward: "auto" or a name
        in `moe_jax.grouped_gemm_backward.WGRADS` ("xla", "torch", "pallas", "mosaic", ...).
      recipe: None, or `moe_jax.fp8_training.Fp8Training()` to run both GEMMs in FP8 on float
        master weights quantized on the fly, with DeepSeek-V3's backward (H and I multiples of
        128; FP8 weights refused).
      fused_act_quant: None (GEMM1, then the act + quantization kernel), or a backend of
        `FUSED_ACT_QUANT_GEMMS` (by name, or an object such as `MosaicFp8Gemm(config)` for its
        tiles) that runs GEMM1, act(gate) * up and the FP8 quantization as one
        kernel (GEMM2 still from `gemm`, on the segment multiple `gemm` asks for). FP8
        inference only (FP8 weights with their scales; no `recipe`, no gradient). Opt-in: on
        the H200 (2026-12-04 and -05, BENCHMARKS.md "Prefill") beside DeepGEMM's GEMM2 it
        takes 12-16 us off shape B's device span per forward (858-868 us against 871-883) but
        adds 135-195 us at shape A, where the Mosaic GEMM1 is slower than DeepGEMM's.
      recompute: what the backward recomputes instead of keeping (`RECOMPUTE_POLICIES`).
        Saved bytes per row of the layout for bf16 tokens (a token has k rows; the layout adds
        at most E * (alignment - 1) padding rows), besides the weights and int32 metadata:
        "none" 4H + 6I (rows [M, H], GEMM1's output [M, 2I], the activation [M, I], GEMM2's
        output [M, H] for the router-weight gradient); "activation" 4H + 4I (act(gate) * up is
        recomputed from GEMM1's output); "gemm2" 2H + 4I (also GEMM2's forward is run again);
        "all" nothing inside the layer (the whole forward runs again in the backward). The
        FP8 recipe keeps the same rows plus, per weight, its FP8 transpose and block scales
        for the dgrad (E * 2I * H + E * H * I bytes, not per token). The same names
        (`RESIDUAL_LAYOUT`, `RESIDUAL_GEMM1`, `RESIDUAL_GEMM2`) serve your own
        `jax.checkpoint(..., policy=jax.checkpoint_policies.save_only_these_names(...))`.
    """

    gemm: str | grouped_gemm.GroupedGemm = "auto"
    permute_impl: str = "auto"
    act_quant_impl: str = "auto"
    alignment: int | None = None
    wgrad: str = "auto"
    recipe: fp8_training.Fp8Training | None = None
    recompute: str = "none"
    fused_act_quant: str | grouped_gemm.GroupedGemm | None = None

    def __post_init__(self):
        if not isinstance(self.permute_impl, str):
            raise TypeError(
                f"ContiguousExperts(permute_impl={self.permute_impl!r}) names the permute and the "
                'weighted gather at once: pass a name ("auto", "xla", "pallas", ...)'
            )
        if self.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(
                f"ContiguousExperts(recompute={self.recompute!r}): choose from "
                f"{sorted(RECOMPUTE_POLICIES)}"
            )
        if self.fused_act_quant is not None and self.recipe is not None:
            raise ValueError(
                f"ContiguousExperts(fused_act_quant={self.fused_act_quant!r}) runs FP8 inference "
                "only; it cannot be combined with a training recipe"
            )

    def select_gemms(self, weights: ExpertWeights, *, num_tokens: int, topk: int, x_dtype):
        """`GemmPair` for T tokens of top-k routing (the FP8 problem under `recipe`)."""
        if self.recipe is not None:
            self.recipe.check(
                hidden=weights.w1.shape[2],
                intermediate=weights.w2.shape[2],
                w_dtype=weights.w1.dtype,
            )
            fp8 = quant.FP8_DTYPE
            weights = ExpertWeights(
                w1=jax.ShapeDtypeStruct(weights.w1.shape, fp8),
                w2=jax.ShapeDtypeStruct(weights.w2.shape, fp8),
            )
            x_dtype = fp8
        return select_gemms(
            self.gemm,
            weights,
            layout="contiguous",
            num_pairs=num_tokens * topk,
            x_dtype=x_dtype,
            alignment=self.alignment,
            fused_act_quant=self.fused_act_quant,
        )

    def permute(
        self, prepared: PreparedTokens, weights: ExpertWeights, *, expert_map, gemms: GemmPair
    ) -> layouts.ContiguousLayout:
        return permute.permute(
            prepared.x,
            prepared.topk_ids,
            num_experts=weights.num_experts,
            x_scales=prepared.x_scales,
            expert_map=expert_map,
            alignment=gemms.alignment,
            is_scales_group_major=gemms.gemm1.is_scales_group_major,
            # FP8 rows are inference only, and every GEMM computes rows independently (padding
            # rows' outputs are never read): the permute need not write zeros there
            is_padding_zeroed=prepared.x.dtype != quant.FP8_DTYPE,
            impl=self.permute_impl,
        )

    def first_gemm(self, lay, weights: ExpertWeights, *, gemms: GemmPair, call: ExpertsCall):
        """[M, H] rows -> [M, 2I] in the intermediate dtype."""
        return self._gemm(
            gemms.gemm1,
            lay.rows,
            lay.row_scales,
            weights.w1,
            weights.w1_scale,
            lay,
            alignment=gemms.alignment,
            out_dtype=intermediate_dtype(lay.rows.dtype, call),
        )

    def first_gemm_act_quant(
        self, lay, weights: ExpertWeights, *, gemms: GemmPair, call: ExpertsCall
    ) -> tuple[jax.Array, jax.Array]:
        """[M, H] FP8 rows -> (float8_e4m3fn[M, I], float32[M, I/128]) in one kernel
        (`gemms.fuses_act_quant`): GEMM1, act(gate) * up and its quantization for GEMM2."""
        if call.quant_config is None or weights.w1_scale is None:
            raise ValueError(
                f"ContiguousExperts(fused_act_quant={self.fused_act_quant!r}) runs the FP8 path "
                "only: pass FP8 weights with w1_scale/w2_scale"
            )
        group = quant.DEFAULT_BLOCK_SHAPE[1]
        if call.quant_config.group_size != group:
            raise ValueError(
                f"fused_act_quant quantizes in groups of {group} columns, the call asks for "
                f"{call.quant_config.group_size}"
            )
        return gemms.gemm1.contiguous_act_quant(
            lay.rows,
            weights.w1,
            lay.expert_ids,
            x_scales=lay.row_scales,
            w1_scales=weights.w1_scale,
            alignment=gemms.alignment,
            activation=call.activation,
        )

    def _gemm(self, backend, x, x_scales, w, w_scales, lay, *, alignment, out_dtype):
        if self.recipe is not None:
            return fp8_training.grouped_gemm_contiguous(
                backend,
                x,
                w,
                lay.expert_ids,
                lay.expert_ends,
                recipe=self.recipe,
                alignment=alignment,
                out_dtype=out_dtype,
                wgrad=self.wgrad,
            )
        return grouped_gemm_contiguous(
            backend,
            x,
            w,
            lay.expert_ids,
            lay.expert_ends,
            x_scales=x_scales,
            w_scales=w_scales,
            alignment=alignment,
            out_dtype=out_dtype,
            wgrad=self.wgrad,
        )

    def activate(self, h: jax.Array, call: ExpertsCall, lay=None, *, gemms: GemmPair | None = None):
        """act(gate) * up (+ quantization); on float paths, padding rows of `lay` are zeroed
        (GEMM1 may leave garbage there, and the weight gradient sums over whole segments); on
        the FP8 path the kernel skips blocks of padding rows, which stay unspecified, and writes
        the scales in the order `gemms.gemm2` reads them."""
        expert_ids = None if lay is None else lay.expert_ids
        return activate(
            h,
            call,
            impl=self.act_quant_impl,
            expert_ids=expert_ids,
            is_scales_group_major=gemms is not None and gemms.gemm2.is_scales_group_major,
        )

    def second_gemm(
        self, a, a_scales, lay, weights: ExpertWeights, *, gemms: GemmPair, call: ExpertsCall
    ):
        """[M, I] activations -> [M, H] in the intermediate dtype."""
        return self._gemm(
            gemms.gemm2,
            a,
            a_scales,
            weights.w2,
            weights.w2_scale,
            lay,
            alignment=gemms.alignment,
            out_dtype=intermediate_dtype(a.dtype, call),
        )

    def unpermute(self, y, lay, prepared: PreparedTokens, call: ExpertsCall) -> jax.Array:
        """Weighted sum of each token's expert rows -> [T, H] in call.out_dtype."""
        return permute.unpermute(
            y, lay.inverse, prepared.topk_weights, out_dtype=call.out_dtype, impl=self.permute_impl
        )

    def apply(self, prepared, weights, *, expert_map, call):
        num_tokens, topk = prepared.topk_ids.shape
        gemms = self.select_gemms(
            weights, num_tokens=num_tokens, topk=topk, x_dtype=prepared.x.dtype
        )

        def forward(prepared, weights, expert_map):
            lay = self.permute(prepared, weights, expert_map=expert_map, gemms=gemms)
            lay = jax.tree.map(lambda a: checkpoint_name(a, RESIDUAL_LAYOUT), lay)
            if gemms.fuses_act_quant:
                a, a_scales = self.first_gemm_act_quant(lay, weights, gemms=gemms, call=call)
            else:
                h = checkpoint_name(
                    self.first_gemm(lay, weights, gemms=gemms, call=call), RESIDUAL_GEMM1
                )
                a, a_scales = self.activate(h, call, lay, gemms=gemms)
            y = self.second_gemm(a, a_scales, lay, weights, gemms=gemms, call=call)
            y = checkpoint_name(y, RESIDUAL_GEMM2)
            return self.unpermute(y, lay, prepared, call)

        saved = RECOMPUTE_POLICIES[self.recompute]
        if saved is not None:
            policy = jax.checkpoint_policies.save_only_these_names(*saved)
            forward = jax.checkpoint(forward, policy=policy)
        return forward(prepared, weights, expert_map)


def masked_mlp(
    rows: jax.Array,
    row_scales: jax.Array | None,
    num_rows_per_expert: jax.Array,
    weights: ExpertWeights,
    *,
    gemm: str | grouped_gemm.GroupedGemm,
    call: ExpertsCall,
    num_pairs: int,
    act_quant_impl: str = "auto",
    expected_m: int | None = None,
) -> jax.Array:
    """The expert MLP on masked blocks: GEMM1 -> act(gate) * up (-> requantize) -> GEMM2.

    Args:
      rows: [E, max_m, H] activations (FP8 with `row_scales` float32[E, max_m, H // 128] on the
        FP8 path); rows at or past `num_rows_per_expert[e]` are ignored.
      num_rows_per_expert: int32[E] valid rows (DeepGEMM's masked_m).
      gemm: GEMM backend name, object or "auto".
      num_pairs: routed pairs the blocks hold at most (for the backend choice).
      act_quant_impl: implementation of act + requantization (`moe_jax.act_quant`).
      expected_m: scheduling hint for tuned backends; None means max_m.

    Returns:
      [E, max_m, H] in the intermediate dtype (bf16 on the FP8 path); rows past the counts are
      unspecified.
    """
    num_experts, max_m = rows.shape[:2]
    gemms = select_gemms(
        gemm, weights, layout="masked", num_pairs=num_pairs, x_dtype=rows.dtype, max_m=max_m
    )
    mid_dtype = intermediate_dtype(rows.dtype, call)
    expected_m = max_m if expected_m is None else expected_m
    h = grouped_gemm_masked(
        gemms.gemm1,
        rows,
        weights.w1,
        num_rows_per_expert,
        x_scales=row_scales,
        w_scales=weights.w1_scale,
        expected_m=expected_m,
        out_dtype=mid_dtype,
    )
    a, a_scales = activate(h.reshape(num_experts * max_m, -1), call, impl=act_quant_impl)
    if a_scales is not None:
        a_scales = a_scales.reshape(num_experts, max_m, -1)
    return grouped_gemm_masked(
        gemms.gemm2,
        a.reshape(num_experts, max_m, -1),
        weights.w2,
        num_rows_per_expert,
        x_scales=a_scales,
        w_scales=weights.w2_scale,
        expected_m=expected_m,
        out_dtype=mid_dtype,
    )


# The masked layout's capacity rule (MaskedExperts): its buffers may exceed those of the
# contiguous layout for the same call, at DeepGEMM's 128-row segments, by at most the bytes of
# the expert weights the call reads.
MASKED_BOUND_ALIGNMENT = layouts.DEFAULT_ALIGNMENT


class MaskedCapacityError(NoImplementationError, ValueError):
    """`MaskedExperts` refuses a problem: `max_m` asks for more rows than its per-expert capacity.

    A ValueError (the value asked for is too large for this problem) and a
    `moe_jax.registry.NoImplementationError` (a refusal whose `refusals` maps the experts' name
    to the reason, as the registries' refusals do).

    Attributes:
      refusals: {experts name: why}.
      problem: the `ExpertsProblem` refused.
    """

    def __init__(self, name: str, problem: ExpertsProblem, why: str):
        super().__init__("experts", problem, {name: why})
        self.problem = problem


def masked_bound_rows(problem: ExpertsProblem) -> int:
    """Rows per expert the masked layout may allocate for `problem` by the byte bound (>= 1).

    E * max_m * row_bytes <= weight_bytes + contiguous_rows * row_bytes, with contiguous_rows
    `layouts.contiguous_num_rows` at `MASKED_BOUND_ALIGNMENT` (see the comment there).
    """
    row_bytes = problem.row_bytes
    contiguous = layouts.contiguous_num_rows(
        problem.num_tokens, problem.topk, problem.num_experts, MASKED_BOUND_ALIGNMENT
    )
    allowed = problem.weight_bytes + contiguous * row_bytes
    return max(1, allowed // (problem.num_experts * row_bytes))


def masked_max_tokens(problem: ExpertsProblem) -> int:
    """The most tokens a call of `problem`'s shapes may have for max_m = T to be within the bound
    (at most T; a chunk_size that makes every chunk fit)."""

    def fits(num_tokens: int) -> bool:
        smaller = dataclasses.replace(problem, num_tokens=num_tokens)
        return num_tokens <= masked_bound_rows(smaller)

    low, high = 1, max(problem.num_tokens, 1)  # fits(1): the bound is at least one row
    while low < high:  # the bound grows by k/E rows per token, max_m = T by one: one crossing
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} bytes"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaskedExperts(Experts):
    """Experts on the masked layout `[E, max_m, H]`.

    A token takes at most one row of an expert (slots repeating an expert share it), so T rows per
    expert never drop anything. The layout holds E * max_m rows whatever the routing, against
    T * k routed pairs: for T=2048 tokens of DeepSeek-V3 (E=256, k=8) that is 524288 rows for
    16384 pairs.

    Capacity: `capacity(problem)`, the largest max_m (at most T) for which the layout's buffers
    (E * max_m rows of `ExpertsProblem.row_bytes`: the token, GEMM1's output, the activation and
    GEMM2's output) take no more bytes than the contiguous layout's for the same call (at
    DeepGEMM's 128-row segments) plus the expert weights the call reads. The padding rows of the
    masked layout thus cost at most one read of the weights, which is a decode step's real work;
    anything larger is far above the work, and ContiguousExperts runs it. DeepSeek-V3 on one GPU
    (H=7168, I=2048, FP8: 32032 bytes a row, 10.5 GiB of weights) gets about 1502 + T/32 rows, so
    max_m = T runs up to T = 1550 and T = 2048 refuses. A request above the capacity raises
    `MaskedCapacityError` at trace time, before anything is allocated; `unsupported_reason` gives
    the same reason without raising.

    Attributes:
      gemm: as for `ContiguousExperts`.
      act_quant_impl: as for `ContiguousExperts`.
      max_m: rows per expert, at most the capacity; None means T. A smaller value drops the
        (token, expert) rows that do not fit (in token order; `moe_jax.layouts.MaskedLayout`
        counts them in `num_dropped`), so use it only when the routing is known to fit (e.g.
        DeepEP's per-rank token limit).
    """

    gemm: str | grouped_gemm.GroupedGemm = "auto"
    act_quant_impl: str = "auto"
    max_m: int | None = None

    def __post_init__(self):
        if self.max_m is not None and (
            not isinstance(self.max_m, int) or isinstance(self.max_m, bool) or self.max_m < 1
        ):
            raise ValueError(f"MaskedExperts(max_m={self.max_m!r}) needs a positive int or None")

    @property
    def name(self) -> str:
        gemm = self.gemm if isinstance(self.gemm, str) else self.gemm.name
        return gemm + MASKED_SUFFIX

    def unsupported_reason(self, problem: ExpertsProblem) -> str | None:
        """None when `max_m` is within `capacity`, else what it would allocate and what to do."""
        num_tokens = max(problem.num_tokens, 1)
        rows_per_expert = num_tokens if self.max_m is None else self.max_m
        bound = masked_bound_rows(problem)
        capacity = min(num_tokens, bound)
        if rows_per_expert <= capacity:
            return None
        if rows_per_expert <= bound:  # within the bytes, above T
            return (
                f"MaskedExperts(max_m={self.max_m}) exceeds the per-expert capacity of "
                f"{capacity} rows for T={problem.num_tokens} tokens (a token takes at most one "
                "row of an expert, so max_m = T never drops); pass max_m <= T or None"
            )
        num_rows = problem.num_experts * rows_per_expert
        row_bytes = problem.row_bytes
        contiguous = layouts.contiguous_num_rows(
            problem.num_tokens, problem.topk, problem.num_experts, MASKED_BOUND_ALIGNMENT
        )
        asked = "max_m=None means T, which never drops" if self.max_m is None else "asked for"
        chunks = (
            f"or run at most {masked_max_tokens(problem)} tokens per call (chunk_size); "
            if self.max_m is None
            else ""
        )
        return (
            f"MaskedExperts(max_m={self.max_m}) exceeds the per-expert capacity of {capacity} "
            f"rows for this problem: {rows_per_expert} rows per expert ({asked}) x E="
            f"{problem.num_experts} = {num_rows} rows of {row_bytes} bytes "
            f"({_size(num_rows * row_bytes)}: rows, GEMM1 output, activation, GEMM2 output) for "
            f"{problem.num_tokens * problem.topk} routed (token, slot) pairs, above the bound of "
            f"{_size(problem.weight_bytes + contiguous * row_bytes)} (the contiguous layout's "
            f"{contiguous} rows plus the {_size(problem.weight_bytes)} of expert weights the call "
            "reads). Use ContiguousExperts instead (experts='auto', or the GEMM name without "
            f"'_masked'), whose rows follow the routed pairs; {chunks}or pass "
            f"MaskedExperts(max_m=m) with m <= {capacity}, which drops the (token, expert) rows "
            "past m in token order (MaskedLayout.num_dropped counts them)"
        )

    def capacity(self, problem: ExpertsProblem) -> int:
        """Rows per expert for `problem`: `max_m` (None: T) when within the capacity (class
        docstring).

        Raises:
          MaskedCapacityError: `max_m` (or T, for None) exceeds the capacity.
        """
        if (why := self.unsupported_reason(problem)) is not None:
            raise MaskedCapacityError(self.name, problem, why)
        return max(problem.num_tokens, 1) if self.max_m is None else self.max_m

    def apply(self, prepared, weights, *, expert_map, call):
        num_tokens, topk = prepared.topk_ids.shape
        max_m = self.capacity(ExpertsProblem.of(prepared, weights, call))
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
            num_pairs=num_tokens * topk,
            act_quant_impl=self.act_quant_impl,
            expected_m=expected_m,
        )
        flat = y.reshape(-1, y.shape[-1])
        return layouts.unpermute_reference(
            flat, lay.inverse, prepared.topk_weights, out_dtype=call.out_dtype
        )


MASKED_SUFFIX = "_masked"
FUSED_SEPARATOR = "+"  # "<gemm>+<fused>": ContiguousExperts(gemm=<gemm>, fused_act_quant=<fused>)


def experts_names() -> tuple[str, ...]:
    """Names `fused_moe(experts=...)` accepts: "auto", each GEMM backend (contiguous layout),
    each backend with the "_masked" suffix (masked layout), and "<gemm>+<fused>" for each fused
    GEMM1 backend of `FUSED_ACT_QUANT_GEMMS` (GEMM1 with act + quantization by <fused>, the
    layout and GEMM2 by <gemm>)."""
    gemms = grouped_gemm.GEMMS.names()
    fused = tuple(
        f"{gemm}{FUSED_SEPARATOR}{name}" for gemm in gemms for name in FUSED_ACT_QUANT_GEMMS
    )
    return ("auto", *gemms, *(name + MASKED_SUFFIX for name in gemms), *fused)


def resolve_experts(experts: str | Experts) -> Experts:
    """An `Experts` object from a name (see `experts_names`) or the object itself.

    "auto" is `ContiguousExperts()`: every stage "auto", so the GEMM registry decides (DeepGEMM,
    torch, Mosaic, then XLA on a GPU; XLA elsewhere). "xla" is the pure-XLA reference for every
    stage, the backward's weight gradient included, on every platform. Another GEMM name is the
    contiguous layout with that backend and automatic permute, activation and weight-gradient
    implementations; "<gemm>_masked" is the masked layout with that backend; "<gemm>+<fused>"
    the contiguous layout with GEMM1, act and quantization fused by <fused> (FP8 only).

    Raises:
      ValueError: an unknown name (the message lists the valid ones).
    """
    if isinstance(experts, Experts):
        return experts
    if not isinstance(experts, str):
        raise TypeError(f"experts={experts!r}: pass a name or an Experts object")
    gemms = grouped_gemm.GEMMS.names()
    if experts == "auto":
        return ContiguousExperts()
    if experts == "xla":
        return ContiguousExperts(gemm="xla", permute_impl="xla", act_quant_impl="xla", wgrad="xla")
    if experts in gemms:
        return ContiguousExperts(gemm=experts)
    gemm, separator, fused = experts.partition(FUSED_SEPARATOR)
    if separator and gemm in gemms and fused in FUSED_ACT_QUANT_GEMMS:
        return ContiguousExperts(gemm=gemm, fused_act_quant=fused)
    base = experts.removesuffix(MASKED_SUFFIX)
    if experts.endswith(MASKED_SUFFIX) and base in gemms:
        return MaskedExperts(gemm=base, act_quant_impl="xla" if base == "xla" else "auto")
    raise ValueError(
        f"unknown experts {experts!r}; choose from {list(experts_names())} "
        "or pass an Experts object"
    )
