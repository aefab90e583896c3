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
call (`ExpertsProblem`), the `Experts` base class, the choice of the two GEMMs' backends
(`select_gemms`) and the activation between them (`activate`).

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

from moe_jax import act_quant, grouped_gemm, quant
from moe_jax._pytree import pytree_dataclass
from moe_jax.activation import act_and_mul
from moe_jax.prepare_finalize import (
    ActivationFormat,
    AlreadyReduced,
    PreparedTokens,
    WeightAndReduce,
)
from moe_jax.registry import AUTO, current_platform

# GEMM backends with a `contiguous_act_quant` method (GEMM1 + act(gate) * up + FP8 quantization
# in one kernel), for `ContiguousExperts(fused_act_quant=...)`.
FUSED_ACT_QUANT_GEMMS = (
    "mosaic_fp8",
    "mosaic_fp8_interpret",
    "mosaic_fp8_gathered",
    "mosaic_fp8_gathered_interpret",
)
# `fused_act_quant="auto"` fuses GEMM1 up to this K (the hidden size H). Evidence (BENCHMARKS.md,
# "Prefill", 2026-12-05 16:31-19:31 UTC, one H100; `bench`'s ms per forward back to back, fused
# against DeepGEMM's GEMM1 and the act + quantization kernel, two rounds each): T=8192 E=128
# k=8 I=768 at H=1024 0.560-0.575 against 0.621-0.623, H=2048 (shape B) 0.995 against
# 1.037-1.043, H=3072 1.415-1.429 against 1.442-1.453; T=4096 E=32 I=2048 at H=2048 0.980-0.992
# against 1.002-1.032; slower from H=4096 (I=1536: 3.29-3.38 against 3.21-3.28; shape A, H=7168:
# 3.36-3.56 against 3.04-3.13). On the H200 shape B's device span was 858-868 us fused against
# 871-883 (2026-12-04): the margin there is smaller, so the bound stays at the largest H with a
# win on both GPUs.
FUSED_ACT_QUANT_MAX_K = 2048
# ... and takes its gathered form ("mosaic_fp8_gathered") up to this N (2I, GEMM1's gate and up
# columns). The gathered GEMM1 saves the permute's copy (proportional to M * H) and pays for its
# row gathers on every column tile (proportional to M * H * N), so its margin shrinks as N
# grows. Evidence (BENCHMARKS.md, "Prefill", 2026-12-06 20:04-23:04 UTC, one H100; `gather_bench`,
# the front half alone, medians of 4 alternating rounds, gathered / permuted + contiguous):
# N=1536 (I=768) 0.965 at shape B (T=8192 E=128 H=2048), 0.955 at H=1024, 0.898 at T=2048;
# N=4096 (T=4096 E=32 I=2048 H=2048) 1.114, slower in every round. At B's T, E and H with I
# varied (2026-12-07, one H100, 3 rounds): N=2048 1.008 (a tie), 3072 1.050, 4096 1.077. The
# whole FP8 layer at shape B on an H100 (2026-12-07, `kernel_gaps`): 915-920 us of device time
# per forward against 940 with the permute and the contiguous kernel. Not measured on an H200.
GATHERED_MAX_N = 1536


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
    `activation_formats`: the formats of prepared tokens it consumes (`ModularMoE` checks).
    """

    activation_formats = (ActivationFormat.STANDARD,)

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
        """What `finalize` applies to `apply`'s output: here nothing (`AlreadyReduced`), as
        these experts weight and sum each token's rows themselves."""
        return AlreadyReduced()


@dataclasses.dataclass(frozen=True)
class GemmPair:
    """The backends of the two GEMMs and the contiguous layout's segment multiple.

    With `fuses_act_quant`, `gemm1` runs GEMM1, act(gate) * up and the FP8 quantization as one
    kernel (its `contiguous_act_quant` method); with `gathers_rows` too, that kernel reads the
    layout's rows from the tokens (its `gathered_act_quant` method), so the layer routes
    (`moe_jax.permute.route`) instead of permuting.
    """

    gemm1: grouped_gemm.GroupedGemm
    gemm2: grouped_gemm.GroupedGemm
    alignment: int | None
    fuses_act_quant: bool = False

    @property
    def gathers_rows(self) -> bool:
        return self.fuses_act_quant and self.gemm1.gathers_rows


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
    activation: str = "silu",
) -> GemmPair:
    """The backends for GEMM1 ([rows, H] x w1) and GEMM2 ([rows, I] x w2), through the registry.

    On the contiguous layout with `alignment=None`, GEMM1's backend sets the segment multiple
    (`GroupedGemm.layout_alignment`) and GEMM2 must accept it too ("auto" moves on to a backend
    that does). `fused_act_quant` names a backend that then runs GEMM1 with act(gate) * up and
    the FP8 quantization fused (`GroupedGemm` with a `contiguous_act_quant` method), on the
    segment multiple `gemm` chose. With `fused_act_quant="auto"` and `gemm="auto"`, GEMM1 is
    fused where `fused_act_quant_preference` names a backend for GEMM1's problem and
    `activation` and that backend accepts it, else not; "auto" beside a named `gemm` never
    fuses (GEMM1 is then the backend asked for).
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
    fused_problem = problem(weights.w1, alignment)
    if fused_act_quant == AUTO:
        fused = _auto_fused_gemm(gemm, fused_problem, activation)
    elif fused_act_quant is not None:
        fused = grouped_gemm.GEMMS.select(fused_act_quant, fused_problem)
    else:
        fused = None
    if fused is None:
        return GemmPair(gemm1=gemm1, gemm2=gemm2, alignment=alignment)
    if layout != "contiguous" or not callable(getattr(fused, "contiguous_act_quant", None)):
        raise ValueError(
            f"fused_act_quant={fused_act_quant!r}: the backend has no GEMM1 with a fused act + "
            f"quantization on the {layout} layout; choose one of "
            f"{list(FUSED_ACT_QUANT_GEMMS)} (contiguous layout)"
        )
    return GemmPair(gemm1=fused, gemm2=gemm2, alignment=alignment, fuses_act_quant=True)


def _auto_fused_gemm(
    gemm: str | grouped_gemm.GroupedGemm, problem: grouped_gemm.GemmProblem, activation: str
) -> grouped_gemm.GroupedGemm | None:
    """`fused_act_quant="auto"`'s fused GEMM1 backend: with `gemm="auto"`, the first of
    `fused_act_quant_preference` that accepts GEMM1's `problem`; None runs GEMM1 unfused."""
    if gemm != AUTO:
        return None
    return grouped_gemm.GEMMS.first_accepting(
        fused_act_quant_preference(problem, activation), problem
    )


def fused_act_quant_preference(
    problem: grouped_gemm.GemmProblem, activation: str
) -> tuple[str, ...]:
    """The fused GEMM1 backends `fused_act_quant="auto"` tries for GEMM1's `problem`, in order;
    () runs GEMM1 and the act + quantization kernel apart.

    The Mosaic GPU kernel on a GPU, for FP8 GEMM1s on the contiguous layout in whole 128-row
    segments (DeepGEMM's, what "auto" picks at prefill sizes; the kernel then orders its tiles
    itself) with K up to `FUSED_ACT_QUANT_MAX_K` and an activation its epilogue compiles (silu):
    there it was faster than DeepGEMM's GEMM1 and the act + quantization kernel, and slower at
    larger K (the evidence beside `FUSED_ACT_QUANT_MAX_K`). Up to N = `GATHERED_MAX_N` its
    gathered form first ("mosaic_fp8_gathered": the rows read from the tokens, so the layer
    routes instead of permuting), then the contiguous form ("mosaic_fp8") for where the gathered
    one refuses the problem (jax 0.10, whose Mosaic GPU has no inline PTX); above it the
    contiguous form only (the evidence beside `GATHERED_MAX_N`).
    """
    from moe_jax.kernels.act_quant import COMPILED_ACTIVATIONS

    is_fused = (
        problem.platform == "gpu"
        and problem.is_fp8
        and problem.layout == "contiguous"
        and problem.k <= FUSED_ACT_QUANT_MAX_K
        and problem.alignment is not None
        and problem.alignment % 128 == 0
        and activation in COMPILED_ACTIVATIONS
    )
    if not is_fused:
        return ()
    return ("mosaic_fp8_gathered", "mosaic_fp8") if problem.n <= GATHERED_MAX_N else ("mosaic_fp8",)


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
