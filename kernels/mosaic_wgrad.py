"""Grouped weight gradient "mosaic": JAX's Mosaic GPU `transposed_ragged_dot` (Hopper, bf16/f16).

dw[e] = dy_e^T x_e over each expert's contiguous rows, [E, N, K], written by XLA-side kernels (no
torch round trip, no copy of the result). The layout's padded segments are the groups (padding
rows are zero). The kernel skips empty groups without writing them, so those experts are zeroed
afterwards (one pass over dw). Named only (`ContiguousExperts(wgrad="mosaic")`): "auto" does
not take it (`moe_jax.plan.wgrad_order`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from moe_jax import grouped_gemm, grouped_gemm_backward


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicWgradConfig:
    """Tile sizes of `transposed_ragged_dot_mgpu.transposed_ragged_dot` (names as there);
    defaults measured in BENCHMARKS.md, Thresholds: `WgradConfig`."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 4


class MosaicWgrad:
    """bf16/f16 grouped wgrad on Hopper through JAX's Mosaic GPU transposed ragged dot."""

    name = "mosaic"

    def __init__(self, config: MosaicWgradConfig | None = None):
        self.config = MosaicWgradConfig() if config is None else config

    def unsupported_reason(self, problem: grouped_gemm.GemmProblem) -> str | None:
        cfg = self.config
        if problem.platform != "gpu":
            return f"Mosaic GPU kernels need an NVIDIA GPU, not {problem.platform!r}"
        if problem.x_dtype not in ("bfloat16", "float16") or problem.x_dtype != problem.w_dtype:
            return f"bf16/f16 operands of one dtype only, got {problem.x_dtype}, {problem.w_dtype}"
        if problem.n % cfg.block_m or problem.k % cfg.block_n:
            return (
                f"N={problem.n} must be a multiple of {cfg.block_m} and K={problem.k} of "
                f"{cfg.block_n}"
            )
        try:
            from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu  # noqa: F401
        except ImportError as error:  # pragma: no cover - depends on the jaxlib build
            return f"jax's Mosaic GPU transposed_ragged_dot is not importable: {error}"
        return None

    def __call__(self, dy, x, expert_ids, expert_ends, *, num_experts, alignment, out_dtype):
        del expert_ids, alignment
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

        cfg = self.config
        sizes = jnp.diff(expert_ends.astype(jnp.int32), prepend=0)
        dw = transposed_ragged_dot_mgpu.transposed_ragged_dot(
            dy,
            x,
            group_sizes=sizes,
            block_m=cfg.block_m,
            block_n=cfg.block_n,
            block_k=cfg.block_k,
            max_concurrent_steps=cfg.max_concurrent_steps,
            grid_block_n=cfg.grid_block_n,
        )
        return jnp.where((sizes > 0)[:, None, None], dw, 0).astype(out_dtype)


grouped_gemm_backward.WGRADS.register(MosaicWgrad())
