"""`ContiguousExperts`: the experts on the contiguous layout.

permute -> GEMM1 -> act(gate) * up (-> requantize) -> GEMM2 -> weighted gather, on expert-major
rows [M, H] (M = T*k plus each expert's segment padded to the alignment): the layout of
DeepGEMM's contiguous GEMMs and torch's grouped GEMM. The gather at the end applies the router
weights and sums each token's slots into [T, H]. Where GEMM1 gathers its rows from the tokens
(`ExpertsPlan.gathers_rows`), the permute only routes: the layout has no rows. `RESIDUAL_*` name
what the backward keeps (`RECOMPUTE_POLICIES`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moe_jax import fp8_training, grouped_gemm, layouts, permute, quant
from moe_jax.experts import (
    Experts,
    ExpertsCall,
    ExpertsProblem,
    ExpertWeights,
    activate,
    intermediate_dtype,
)
from moe_jax.fused_gemm1 import FusedGemm1, fused_gemm1
from moe_jax.grouped_gemm_backward import grouped_gemm_contiguous
from moe_jax.plan import (  # RECOMPUTE_POLICIES and RESIDUAL_*: re-exported, named here before
    RECOMPUTE_POLICIES,  # noqa: F401
    RESIDUAL_GEMM1,
    RESIDUAL_GEMM2,
    RESIDUAL_LAYOUT,
    ExpertsPlan,
    check_choices,
)
from moe_jax.plan import plan as build_plan
from moe_jax.prepare_finalize import PreparedTokens
from moe_jax.registry import AUTO


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContiguousExperts(Experts):
    """Experts on the contiguous layout: permute -> GEMM1 -> act (+quant) -> GEMM2 -> unpermute.

    Each stage is a public method taking the call's `ExpertsPlan` (`plan`), so profiles and
    benchmarks time the same code that `apply` runs. Every choice is the plan's (`moe_jax.plan`);
    "auto" is the fastest that runs here.

    Attributes:
      gemm: GEMM backend name, a `GroupedGemm`, or "auto" (`moe_jax.grouped_gemm.GEMMS`).
      permute_impl: implementation of the permute and of the weighted gather (`moe_jax.permute`).
      act_quant_impl: implementation of act(gate) * up + FP8 requantization (`moe_jax.act_quant`).
      alignment: rows per expert segment multiple; None takes GEMM1's backend's own for the
        call (`moe_jax.plan.segment_alignment`: DeepGEMM 128; Pallas 16-64 by pairs per expert).
      wgrad: implementation of the grouped weight gradient in the backward: "auto" or a name
        in `moe_jax.grouped_gemm_backward.WGRADS` ("xla", "torch", "pallas", "mosaic", ...).
      recipe: None, or `moe_jax.fp8_training.Fp8Training()` to run both GEMMs in FP8 on float
        master weights quantized on the fly, with DeepSeek-V3's backward (H and I multiples of
        128; FP8 weights refused).
      fused_act_quant: "auto", None (GEMM1, then the act + quantization kernel), or a fused
        GEMM1 (`moe_jax.fused_gemm1.FUSED_GEMM1S`, by name or as an object such as
        `MosaicFp8FusedGemm1(config)`) that runs GEMM1, act(gate) * up and the FP8 quantization
        as one op (GEMM2 still from `gemm`, on the segment multiple `gemm` asks for). FP8
        inference only. "auto" fuses beside `gemm="auto"` and no `recipe` where
        `moe_jax.plan.fused_gemm1_order` says the fused GEMM1 is the faster.
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
    fused_act_quant: str | FusedGemm1 | None = AUTO

    def __post_init__(self):
        if not isinstance(self.permute_impl, str):
            raise TypeError(
                f"ContiguousExperts(permute_impl={self.permute_impl!r}) names the permute and the "
                'weighted gather at once: pass a name ("auto", "xla", "pallas", ...)'
            )
        check_choices(
            recompute=self.recompute, fused_act_quant=self.fused_act_quant, recipe=self.recipe
        )

    def plan(self, problem: ExpertsProblem) -> ExpertsPlan:
        """The `ExpertsPlan` these experts run `problem` with (`moe_jax.plan.plan`)."""
        return build_plan(
            problem,
            gemm=self.gemm,
            fused_act_quant=self.fused_act_quant,
            alignment=self.alignment,
            permute_impl=self.permute_impl,
            act_quant_impl=self.act_quant_impl,
            wgrad=self.wgrad,
            recipe=self.recipe,
            recompute=self.recompute,
        )

    def plan_for(
        self, weights: ExpertWeights, *, num_tokens: int, topk: int, x_dtype, call=None
    ) -> ExpertsPlan:
        """`plan` for T = `num_tokens` tokens of top-k routing with rows of `x_dtype`, without
        the tokens (benchmarks, notebooks); `call` None quantizes FP8 rows in 128-column groups."""
        if call is None:
            is_fp8 = jnp.dtype(x_dtype) == quant.FP8_DTYPE
            call = ExpertsCall(quant_config=quant.Fp8BlockQuant() if is_fp8 else None)
        shapes = PreparedTokens(
            x=jax.ShapeDtypeStruct((num_tokens, weights.w1.shape[2]), x_dtype),
            x_scales=None,
            topk_ids=jax.ShapeDtypeStruct((num_tokens, topk), jnp.int32),
            topk_weights=None,
        )
        return self.plan(ExpertsProblem.of(shapes, weights, call))

    def permute(
        self, prepared: PreparedTokens, weights: ExpertWeights, *, expert_map, plan: ExpertsPlan
    ) -> layouts.ContiguousLayout:
        """[T, H] tokens -> the contiguous layout of `plan.alignment`-row expert segments
        (`moe_jax.permute.permute`; FP8 rows carry their scales in the order GEMM1 reads)."""
        return permute.permute(
            prepared.x,
            prepared.topk_ids,
            num_experts=weights.num_experts,
            x_scales=prepared.x_scales,
            expert_map=expert_map,
            alignment=plan.alignment,
            is_scales_group_major=plan.gemm1.is_scales_group_major,
            # FP8 rows are inference only, and every GEMM computes rows independently (padding
            # rows' outputs are never read): the permute need not write zeros there
            is_padding_zeroed=prepared.x.dtype != quant.FP8_DTYPE,
            impl=plan.permute_impl,
        )

    def route(
        self, prepared: PreparedTokens, weights: ExpertWeights, *, expert_map, plan: ExpertsPlan
    ) -> layouts.ContiguousLayout:
        """The layout without its rows (`moe_jax.permute.route`), for a GEMM1 that gathers
        them from the tokens (`plan.gathers_rows`)."""
        return permute.route(
            prepared.topk_ids,
            num_experts=weights.num_experts,
            expert_map=expert_map,
            alignment=plan.alignment,
        )

    def arrange(
        self, prepared: PreparedTokens, weights: ExpertWeights, *, expert_map, plan: ExpertsPlan
    ) -> layouts.ContiguousLayout:
        """The layout GEMM1 reads: `route`'s or `permute`'s, as `plan.arrange` says."""
        arrange = self.route if plan.gathers_rows else self.permute
        return arrange(prepared, weights, expert_map=expert_map, plan=plan)

    def first_gemm(self, lay, weights: ExpertWeights, *, plan: ExpertsPlan, call: ExpertsCall):
        """[M, H] rows -> [M, 2I] in the intermediate dtype."""
        return self._gemm(0, lay.rows, lay.row_scales, weights, lay, plan, call)

    def first_gemm_act_quant(
        self,
        lay,
        weights: ExpertWeights,
        *,
        plan: ExpertsPlan,
        call: ExpertsCall,
        prepared: PreparedTokens | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """[M, H] FP8 rows -> (float8_e4m3fn[M, I], float32[M, I/128]) by the plan's fused
        GEMM1 (`moe_jax.fused_gemm1`); on `route`'s layout (no rows) it reads them from
        `prepared`'s tokens."""
        if plan.gathers_rows and prepared is None:
            raise ValueError(
                "the layout from `route` holds no rows: pass prepared= (the tokens GEMM1 "
                "gathers them from)"
            )
        x, x_scales = (
            (prepared.x, prepared.x_scales) if plan.gathers_rows else (lay.rows, lay.row_scales)
        )
        return fused_gemm1(
            x,
            weights.w1,
            lay.expert_ids,
            x_scales=x_scales,
            w1_scales=weights.w1_scale,
            alignment=plan.alignment,
            activation=call.activation,
            row_sources=lay.sources if plan.gathers_rows else None,
            impl=plan.gemm1,
        )

    def _gemm(self, stage: int, x, x_scales, weights, lay, plan: ExpertsPlan, call):
        """GEMM `stage` (0: GEMM1, 1: GEMM2) with the plan's backends for it and its backward."""
        return grouped_gemm_contiguous(
            (plan.gemm1, plan.gemm2)[stage],
            x,
            (weights.w1, weights.w2)[stage],
            lay.expert_ids,
            lay.expert_ends,
            x_scales=x_scales,
            w_scales=(weights.w1_scale, weights.w2_scale)[stage],
            alignment=plan.alignment,
            out_dtype=intermediate_dtype(x.dtype, call),
            wgrad=None if plan.wgrads is None else plan.wgrads[stage],
            dgrad=None if plan.dgrads is None else plan.dgrads[stage],
            recipe=plan.recipe,  # which quantizes x and w itself
        )

    def activate(self, h: jax.Array, call: ExpertsCall, lay=None, *, plan: ExpertsPlan):
        """act(gate) * up (+ quantization where the plan has an act + quant kernel: FP8 rows);
        on float rows, padding rows of `lay` are zeroed (GEMM1 may leave garbage there, and the
        weight gradient sums over whole segments), and FP8 GEMMs quantize their rows
        themselves; on FP8 rows the kernel skips blocks of padding rows, which stay
        unspecified, and writes the scales in the order `plan.gemm2` reads them."""
        return activate(
            h,
            call if plan.act_quant_impl else dataclasses.replace(call, quant_config=None),
            impl=plan.act_quant_impl or AUTO,
            expert_ids=None if lay is None else lay.expert_ids,
            is_scales_group_major=plan.gemm2.is_scales_group_major,
        )

    def second_gemm(
        self, a, a_scales, lay, weights: ExpertWeights, *, plan: ExpertsPlan, call: ExpertsCall
    ):
        """[M, I] activations -> [M, H] in the intermediate dtype."""
        return self._gemm(1, a, a_scales, weights, lay, plan, call)

    def unpermute(
        self, y, lay, prepared: PreparedTokens, call: ExpertsCall, *, plan: ExpertsPlan
    ) -> jax.Array:
        """Weighted sum of each token's expert rows -> [T, H] in call.out_dtype."""
        return permute.unpermute(
            y,
            lay.inverse,
            prepared.topk_weights,
            out_dtype=call.out_dtype,
            impl=plan.unpermute_impl,
        )

    def apply(self, prepared, weights, *, expert_map, call):
        p = self.plan(ExpertsProblem.of(prepared, weights, call))

        def forward(prepared, weights, expert_map):
            lay = self.arrange(prepared, weights, expert_map=expert_map, plan=p)
            lay = jax.tree.map(lambda a: checkpoint_name(a, RESIDUAL_LAYOUT), lay)
            if p.fuses_act_quant:
                a, a_scales = self.first_gemm_act_quant(
                    lay, weights, plan=p, call=call, prepared=prepared
                )
            else:
                h = self.first_gemm(lay, weights, plan=p, call=call)
                a, a_scales = self.activate(checkpoint_name(h, RESIDUAL_GEMM1), call, lay, plan=p)
            y = self.second_gemm(a, a_scales, lay, weights, plan=p, call=call)
            y = checkpoint_name(y, RESIDUAL_GEMM2)
            return self.unpermute(y, lay, prepared, call, plan=p)

        if p.saved_residuals is not None:
            policy = jax.checkpoint_policies.save_only_these_names(*p.saved_residuals)
            forward = jax.checkpoint(forward, policy=policy)
        return forward(prepared, weights, expert_map)
