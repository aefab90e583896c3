"""Grouped-GEMM problems shared by the test modules of the GEMM backends and kernels."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax import grouped_gemm, layouts
from moe_jax.grouped_gemm import GemmProblem
from moe_jax.kernels import grouped_gemm as gg


@dataclasses.dataclass(frozen=True)
class RoutedProblem:
    """A grouped GEMM to build seeded operands for: T tokens routed to `topk` of E experts,
    tokens [T, k], each expert's weight [n, k].

    Attributes:
      name: the pytest id.
      num_tokens, topk, num_experts: T, k and E of the routing.
      n, k: the weight's output columns and reduction size.
      alignment: rows per expert segment multiple of the contiguous layout.
      dtype: "fp8" (vLLM's block-quantized operands) or "bfloat16", where a module tests both.
      only_experts: route only to these experts (the rest stay empty); None: any id, invalid
        ones included where the module draws them.
    """

    name: str
    num_tokens: int
    topk: int
    num_experts: int
    n: int
    k: int
    alignment: int = 16
    dtype: str = "fp8"
    only_experts: tuple[int, ...] | None = None

    def __str__(self) -> str:
        return self.name


# DeepSeek-V3's GEMM1 (N = 2I = 4096, K = H = 7168, 256 experts) in FP8 on a GPU: the static
# problem the backends' acceptance tests vary one field at a time (`dataclasses.replace`).
DEEPSEEK_V3_FP8_GEMM1 = GemmProblem(
    layout="contiguous",
    n=4096,
    k=7168,
    num_experts=256,
    num_pairs=16384,
    x_dtype="float8_e4m3fn",
    w_dtype="float8_e4m3fn",
    platform="gpu",
)


# The contract every grouped-GEMM backend meets (tests/test_contract_grouped_gemm.py): padding
# and out-of-range ids, one expert, empty experts, one token, no tokens, each operand dtype.
CONTRACT_PROBLEMS = [
    RoutedProblem("fp8_padding_and_invalid_ids", 9, 2, 4, 256, 256),
    RoutedProblem("fp8_single_expert", 5, 1, 1, 128, 384, alignment=32),
    RoutedProblem(
        "fp8_empty_experts_align64", 11, 3, 8, 128, 256, alignment=64, only_experts=(1, 6)
    ),
    RoutedProblem("bf16_empty_experts", 7, 3, 8, 48, 96, dtype="bfloat16", only_experts=(0, 5, 7)),
    RoutedProblem("bf16_one_token", 1, 1, 3, 64, 32, dtype="bfloat16"),
    RoutedProblem("bf16_no_tokens", 0, 2, 3, 64, 32, dtype="bfloat16"),
    RoutedProblem("f32_duplicate_ids", 6, 3, 4, 32, 64, dtype="float32", only_experts=(1, 2)),
]


def routed_operands(problem: RoutedProblem, rng):
    """(x, w, x_scales, w_scales, ids) in numpy for `problem`: FP8 by vLLM's recipe (scales
    float32), else the problem's dtype (scales None); ids int32[T, topk] drawn from
    `only_experts`, else from [-1, E] (invalid ids on both sides)."""
    import numpy as np
    import oracles

    shape = (problem.num_tokens, problem.topk)
    if problem.only_experts is not None:
        ids = rng.choice(np.array(problem.only_experts), size=shape)
    else:
        ids = rng.integers(-1, problem.num_experts + 1, size=shape)
    x = rng.standard_normal((problem.num_tokens, problem.k)).astype(np.float32)
    w = (rng.standard_normal((problem.num_experts, problem.n, problem.k)) / 8).astype(np.float32)
    if problem.dtype == "fp8":
        x, x_scales = oracles.per_token_group_quant_fp8(x)
        w, w_scales = oracles.per_block_quant_fp8(w)
        return x, w, x_scales, w_scales, ids.astype(np.int32)
    dtype = oracles.BF16 if problem.dtype == "bfloat16" else np.float32
    return x.astype(dtype), w.astype(dtype), None, None, ids.astype(np.int32)


def grouped_gemm_contiguous_reference(
    x: jax.Array,
    w: jax.Array,
    expert_ids: jax.Array,
    *,
    x_scales: jax.Array | None = None,
    w_scales: jax.Array | None = None,
    alignment: int,
    out_dtype: jnp.dtype = jnp.bfloat16,
) -> jax.Array:
    """Pure-JAX `grouped_gemm_contiguous` (`moe_jax.kernels.grouped_gemm`): dequantized float32
    operands, one expert per row.

    Gathers each row's expert weights ([M, N, K] float32), so keep it to test sizes. Padding rows
    are zero. `alignment` is checked as in the kernel and otherwise unused (rows are independent).
    """
    gg.check_operands(x, w, expert_ids, x_scales, w_scales, alignment)
    a = grouped_gemm.dequant_rows(x, x_scales).astype(jnp.float32)
    b = grouped_gemm.dequant_weights(w, w_scales).astype(jnp.float32)
    ids = layouts.ids_as_int32(expert_ids)
    is_valid = (ids >= 0) & (ids < w.shape[0])
    per_row = b[jnp.clip(ids, 0, w.shape[0] - 1)]
    y = jnp.einsum("mk,mnk->mn", a, per_row, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(is_valid[:, None], y, 0.0).astype(out_dtype)
