"""`ContiguousExperts`: the experts on the contiguous layout, and its residuals' names.

permute -> GEMM1 -> act(gate) * up (-> requantize) -> GEMM2 -> weighted gather, on expert-major
rows [M, H] (M = T*k plus each expert's segment padded to the GEMMs' alignment): the layout of
DeepGEMM's contiguous GEMMs and torch's grouped GEMM. The gather at the end applies the router
weights and sums each token's slots into [T, H]. With a fused GEMM1 that gathers its rows from
the tokens (`GemmPair.gathers_rows`), the permute only routes: the layout has no rows.
`RESIDUAL_*` name what the backward keeps
(`RECOMPUTE_POLICIES`). The pieces both layouts share (`ExpertWeights`, `ExpertsCall`,
`select_gemms`, `activate`) are in `moe_jax.experts`.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.ad_checkpoint import checkpoint_name

from moe_jax import fp8_training, grouped_gemm, layouts, permute, quant
from moe_jax.experts import (
    Experts,
    ExpertsCall,
    ExpertWeights,
    GemmPair,
    activate,
    intermediate_dtype,
    select_gemms,
)
from moe_jax.grouped_gemm_backward import grouped_gemm_contiguous
from moe_jax.prepare_finalize import PreparedTokens
from moe_jax.registry import AUTO

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
      fused_act_quant: "auto", None (GEMM1, then the act + quantization kernel), or a backend
        of `moe_jax.experts.FUSED_ACT_QUANT_GEMMS` (by name, or an object such as
        `MosaicFp8Gemm(config)` for its tiles) that runs GEMM1, act(gate) * up and the FP8
        quantization as one kernel (GEMM2 still from `gemm`, on the segment multiple `gemm` asks
        for). FP8 inference only (FP8 weights with their scales; no `recipe`, no gradient).
        "auto" (with `gemm="auto"` and no `recipe`; else it never fuses) fuses where
        `moe_jax.experts.fused_act_quant_preference` says the fused kernel is the faster: FP8
        on a Hopper GPU, DeepGEMM's 128-row segments, silu, H up to
        `moe_jax.experts.FUSED_ACT_QUANT_MAX_K` (2048). There, beside DeepGEMM's GEMM2, it takes
        12-16 us off shape B's device span per forward on the H200 (858-868 us against 871-883,
        2026-12-04) and 4-9% off the forward on an H100 at H=1024-2048 (2026-12-05); at shape A
        (H=7168) it is 7-17% slower (BENCHMARKS.md, "Prefill"). Where "auto" fuses and GEMM1's
        N (2I) is at most `moe_jax.experts.GATHERED_MAX_N`, it takes the fused GEMM1's gathered
        form ("mosaic_fp8_gathered", jax 0.11 or later): it reads GEMM1's rows from the tokens,
        the layer then routes (`route`) instead of permuting, and the permuted rows are never
        copied (2.1-2.7% less device time at shape B on an H100, 915-920 us per forward against
        940, 2026-12-07; not measured on the H200, where the permute's copy costs less). Named,
        it takes `alignment=128`.
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
    fused_act_quant: str | grouped_gemm.GroupedGemm | None = AUTO

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
        if self.fused_act_quant not in (None, AUTO) and self.recipe is not None:
            raise ValueError(
                f"ContiguousExperts(fused_act_quant={self.fused_act_quant!r}) runs FP8 inference "
                "only; it cannot be combined with a training recipe"
            )

    def select_gemms(
        self,
        weights: ExpertWeights,
        *,
        num_tokens: int,
        topk: int,
        x_dtype,
        activation: str = "silu",
    ):
        """`GemmPair` for T tokens of top-k routing (the FP8 problem under `recipe`) and the
        gated `activation` (which decides whether "auto" may fuse GEMM1 with it)."""
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
            fused_act_quant=None if self.recipe is not None else self.fused_act_quant,
            activation=activation,
        )

    def permute(
        self, prepared: PreparedTokens, weights: ExpertWeights, *, expert_map, gemms: GemmPair
    ) -> layouts.ContiguousLayout:
        """[T, H] tokens -> the contiguous layout of `gemms.alignment`-row expert segments
        (`moe_jax.permute.permute`; FP8 rows carry their scales in the order GEMM1 reads)."""
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

    def route(
        self, prepared: PreparedTokens, weights: ExpertWeights, *, expert_map, gemms: GemmPair
    ) -> layouts.ContiguousLayout:
        """The layout without its rows (`moe_jax.permute.route`), for a GEMM1 that gathers
        them from the tokens (`gemms.gathers_rows`)."""
        return permute.route(
            prepared.topk_ids,
            num_experts=weights.num_experts,
            expert_map=expert_map,
            alignment=gemms.alignment,
        )

    def arrange(
        self, prepared: PreparedTokens, weights: ExpertWeights, *, expert_map, gemms: GemmPair
    ) -> layouts.ContiguousLayout:
        """The layout GEMM1 reads: `route`'s (no rows) where it gathers them from the tokens
        (`gemms.gathers_rows`), else `permute`'s."""
        arrange = self.route if gemms.gathers_rows else self.permute
        return arrange(prepared, weights, expert_map=expert_map, gemms=gemms)

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
        self,
        lay,
        weights: ExpertWeights,
        *,
        gemms: GemmPair,
        call: ExpertsCall,
        prepared: PreparedTokens | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """[M, H] FP8 rows -> (float8_e4m3fn[M, I], float32[M, I/128]) in one kernel
        (`gemms.fuses_act_quant`): GEMM1, act(gate) * up and its quantization for GEMM2. On
        `route`'s layout (no rows) the kernel reads them from `prepared`'s tokens."""
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
        if lay.rows is None:  # `route`'s layout: the kernel reads the rows from the tokens
            if prepared is None:
                raise ValueError(
                    "the layout from `route` holds no rows: pass prepared= (the tokens GEMM1 "
                    "gathers them from)"
                )
            return gemms.gemm1.gathered_act_quant(
                prepared.x,
                weights.w1,
                lay.expert_ids,
                lay.sources,
                x_scales=prepared.x_scales,
                w1_scales=weights.w1_scale,
                alignment=gemms.alignment,
                activation=call.activation,
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
            weights,
            num_tokens=num_tokens,
            topk=topk,
            x_dtype=prepared.x.dtype,
            activation=call.activation,
        )

        def forward(prepared, weights, expert_map):
            lay = self.arrange(prepared, weights, expert_map=expert_map, gemms=gemms)
            lay = jax.tree.map(lambda a: checkpoint_name(a, RESIDUAL_LAYOUT), lay)
            if gemms.fuses_act_quant:
                a, a_scales = self.first_gemm_act_quant(
                    lay, weights, gemms=gemms, call=call, prepared=prepared
                )
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
