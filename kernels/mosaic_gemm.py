"""Grouped-GEMM backend "mosaic": JAX's own Mosaic GPU `ragged_dot` kernel (bf16/f16, Hopper).

The bf16 fast path when DeepGEMM and torch are both unavailable: it wraps
`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot`. The contiguous layout's padded
segments are its groups; padding rows are computed (zeros in, zeros out) and rows past the last
segment are left unspecified, as the GroupedGemm contract allows.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from moe_jax import grouped_gemm


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicGemmConfig:
    """Tile sizes of `ragged_dot_mgpu.ragged_dot` (names as there)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 4


class MosaicGemm(grouped_gemm.GroupedGemm):
    """bf16/f16 grouped GEMM on Hopper through JAX's Mosaic GPU ragged_dot."""

    name = "mosaic"

    def __init__(self, config: MosaicGemmConfig | None = None):
        self.config = MosaicGemmConfig() if config is None else config

    def unsupported_reason(self, problem: grouped_gemm.GemmProblem) -> str | None:
        cfg = self.config
        if problem.platform != "gpu":
            return f"Mosaic GPU kernels need an NVIDIA GPU, not {problem.platform!r}"
        if problem.is_fp8 or problem.x_dtype not in ("bfloat16", "float16"):
            return f"bf16/f16 operands only, got x {problem.x_dtype} and w {problem.w_dtype}"
        if problem.x_dtype != problem.w_dtype:
            return f"x and w dtypes differ ({problem.x_dtype}, {problem.w_dtype})"
        if problem.k % cfg.block_k:
            return f"K={problem.k} is not a multiple of block_k={cfg.block_k}"
        if problem.n % (cfg.block_n * cfg.grid_block_n):
            return f"N={problem.n} is not a multiple of {cfg.block_n * cfg.grid_block_n}"
        try:
            from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # noqa: F401
        except ImportError as error:  # pragma: no cover - depends on the jaxlib build
            return f"jax's Mosaic GPU ragged_dot is not importable: {error}"
        return None

    def ragged_dot(self, x, w, group_sizes, out_dtype):
        """x [M, K] @ w[g].T per group of consecutive rows (`group_sizes` int[G]) -> [M, N]."""
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

        cfg = self.config
        y = ragged_dot_mgpu.ragged_dot(
            x,
            w,
            group_sizes=group_sizes.astype(jnp.int32),
            block_m=cfg.block_m,
            block_n=cfg.block_n,
            block_k=cfg.block_k,
            max_concurrent_steps=cfg.max_concurrent_steps,
            grid_block_n=cfg.grid_block_n,
            transpose_rhs=True,
        )
        return y.astype(out_dtype)

    def contiguous(
        self, x, w, expert_ids, expert_ends, *, x_scales=None, w_scales=None, alignment, out_dtype
    ):
        del expert_ids, x_scales, w_scales, alignment  # segments come from expert_ends
        if x.shape[0] == 0:
            return jnp.zeros((0, w.shape[1]), out_dtype)
        sizes = jnp.diff(expert_ends, prepend=0)
        return self.ragged_dot(x, w, sizes, out_dtype)

    def masked(
        self, x, w, num_rows_per_expert, *, x_scales=None, w_scales=None, expected_m=None, out_dtype
    ):
        del num_rows_per_expert, x_scales, w_scales, expected_m  # rows past the count: unspecified
        num_experts, max_m, k = x.shape
        sizes = jnp.full((num_experts,), max_m, jnp.int32)
        y = self.ragged_dot(x.reshape(num_experts * max_m, k), w, sizes, out_dtype)
        return y.reshape(num_experts, max_m, -1)


grouped_gemm.GEMMS.register(MosaicGemm())
