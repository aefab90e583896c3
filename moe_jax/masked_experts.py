"""`MaskedExperts`: the experts on the masked layout `[E, max_m, H]`, and its capacity rule.

The layout of DeepGEMM's masked GEMMs and of what DeepEP's low-latency dispatch delivers: each
expert gets a block of max_m rows, of which the first `num_rows_per_expert[e]` are valid.
`masked_mlp` runs the expert MLP on such blocks; `MaskedExperts` runs it on masked-format tokens
(DeepEP low latency, `MaskedPrepareFinalize`) and, given token rows, builds the blocks itself,
bounded by `masked_bound_rows` (refusals raise `MaskedCapacityError`). The shared pieces
(`ExpertWeights`, `ExpertsCall`, `ExpertsProblem`, `activate`) are in `moe_jax.experts`; the
GEMM pair comes from `moe_jax.plan.masked_gemms`.
"""

from __future__ import annotations

import dataclasses

import jax

from moe_jax import grouped_gemm, layouts, quant
from moe_jax.experts import (
    Experts,
    ExpertsCall,
    ExpertsProblem,
    ExpertWeights,
    activate,
    intermediate_dtype,
)
from moe_jax.grouped_gemm_backward import grouped_gemm_masked
from moe_jax.plan import masked_gemms
from moe_jax.prepare_finalize import ActivationFormat, MaskedPrepareFinalize, MaskedTokens
from moe_jax.registry import NoImplementationError

MASKED_SUFFIX = "_masked"  # "<gemm>_masked": MaskedExperts(gemm=<gemm>)

# The contiguous layout's segment multiple that the capacity rule compares with (`MaskedExperts`)
MASKED_BOUND_ALIGNMENT = layouts.DEFAULT_ALIGNMENT


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
        FP8 path; float rows meeting FP8 weights are quantized in the GEMMs, differentiably with
        the weights held constant); rows at or past `num_rows_per_expert[e]` are ignored.
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
    gemms, dgrads = masked_gemms(gemm, weights, rows, num_pairs=num_pairs)
    mid_dtype = intermediate_dtype(rows.dtype, call)
    expected_m = max_m if expected_m is None else expected_m
    h = grouped_gemm_masked(
        gemms[0],
        rows,
        weights.w1,
        num_rows_per_expert,
        x_scales=row_scales,
        w_scales=weights.w1_scale,
        expected_m=expected_m,
        out_dtype=mid_dtype,
        dgrad=dgrads[0],
    )
    if rows.dtype != quant.FP8_DTYPE:  # float rows: GEMM2 quantizes the activation itself
        call = dataclasses.replace(call, quant_config=None)
    a, a_scales = activate(h.reshape(num_experts * max_m, -1), call, impl=act_quant_impl)
    if a_scales is not None:
        a_scales = a_scales.reshape(num_experts, max_m, -1)
    return grouped_gemm_masked(
        gemms[1],
        a.reshape(num_experts, max_m, -1),
        weights.w2,
        num_rows_per_expert,
        x_scales=a_scales,
        w_scales=weights.w2_scale,
        expected_m=expected_m,
        out_dtype=mid_dtype,
        dgrad=dgrads[1],
    )


class MaskedCapacityError(NoImplementationError, ValueError):
    """`MaskedExperts` refuses a problem: `max_m` asks for more rows than its per-expert capacity.

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
    `layouts.contiguous_num_rows` at `MASKED_BOUND_ALIGNMENT` (`MaskedExperts`' capacity).
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
    """Experts on the masked layout `[E, max_m, H]`: they consume masked tokens (DeepEP low
    latency, `MaskedPrepareFinalize`) and token rows, which they lay out with the latter.

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
      max_m: rows per expert for token rows, at most the capacity; None means T (masked tokens
        come in blocks sized by their prepare). A smaller value drops the
        (token, expert) rows that do not fit (in token order; `moe_jax.layouts.MaskedLayout`
        counts them in `num_dropped`), so use it only when the routing is known to fit (e.g.
        DeepEP's per-rank token limit).
    """

    activation_formats = (ActivationFormat.STANDARD, ActivationFormat.MASKED)
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
        """Masked tokens -> unweighted blocks [E, max_m, H] in the intermediate dtype (the
        prepare's finalize weights them); token rows -> their weighted sum [T, H]."""
        if prepared.activation_format is ActivationFormat.MASKED:
            if expert_map is not None:
                raise ValueError(
                    "expert_map with masked tokens, whose prepare mapped the ids already: pass it "
                    "to MaskedPrepareFinalize(expert_map=...), or None (DeepEP maps by rank)"
                )
            return self._mlp(prepared, weights, call)
        max_m = self.capacity(ExpertsProblem.of(prepared, weights, call))
        pf = MaskedPrepareFinalize(
            num_experts=weights.num_experts, max_m=max_m, expert_map=expert_map
        )
        blocks = pf.blocks(prepared)
        y = self._mlp(blocks, weights, call)
        return pf.finalize(y, blocks, self.weight_and_reduce(), out_dtype=call.out_dtype)

    def _mlp(self, tokens: MaskedTokens, weights: ExpertWeights, call: ExpertsCall) -> jax.Array:
        num_experts, max_m = tokens.x.shape[:2]
        num_tokens, topk = tokens.topk_ids.shape
        # DeepGEMM's scheduling hint: the mean rows per expert, rounded up to 16 (vLLM's choice).
        expected_m = max(16, min(max_m, layouts.round_up(-(-num_tokens * topk // num_experts), 16)))
        return masked_mlp(
            tokens.x,
            tokens.x_scales,
            tokens.num_tokens_per_expert,
            weights,
            gemm=self.gemm,
            call=call,
            num_pairs=max(num_tokens, max_m) * topk,  # T * k routed here; DeepEP: R * T_max * k
            act_quant_impl=self.act_quant_impl,
            expected_m=expected_m,
        )
