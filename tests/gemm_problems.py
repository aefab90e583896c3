"""Grouped-GEMM problems shared by the test modules of the GEMM backends and kernels."""

from __future__ import annotations

import dataclasses

from moe_jax.grouped_gemm import GemmProblem


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
