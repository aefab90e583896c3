"""The FP8 training recipe of DeepSeek-V3 for the expert GEMMs.

Master weights stay in bf16/float32; each step quantizes them on the fly. Per GEMM
`y[row] = x[row] @ w[expert(row)].T` ([M, K] x [E, N, K] -> [M, N], contiguous layout), through
`moe_jax.grouped_gemm_backward.grouped_gemm_contiguous(recipe=...)`:

- forward: x quantized in 1x128 groups (`moe_jax.act_quant.group_quant`), w in 128x128 blocks
  (`quantize_blocks`), one FP8 grouped GEMM (DeepGEMM on a Hopper GPU), bf16 out.
- dgrad: dy quantized in 1x128 groups along N, times a physical w^T [E, K, N] quantized in 128x128
  blocks: both operands K-major, as DeepGEMM's sm_90 `m_grouped_fp8_gemm_nt_contiguous` needs. The
  128x128 tiles of w^T are the transposed tiles of w with the same scales, so quantizing w^T is
  quantizing w and transposing: no extra error. (Frozen FP8 weights take the same dgrad.)
- wgrad: dw = dy^T x in bf16 (float32 accumulation) through `WGRADS`, with the unquantized bf16
  x and dy. DeepGEMM's sm_90 FP8 wgrad (`k_grouped_fp8_gemm_nt_contiguous`) takes the per-expert
  row counts as a host list, i.e. a device-to-host sync every step; it is not used.
- Straight-through the quantizers: the gradient of the quantize-dequantize is taken as identity
  (dx uses the quantized w, dw the unquantized x).

Residuals per GEMM: x (2 * K bytes per row in bf16) and the FP8 w^T with its scales (E * N * K
bytes; w and w^T are quantized together in the forward, one read of w). Rows of padding are
handled as in `moe_jax.grouped_gemm_backward`.

Example:
  >>> from moe_jax import fused_moe
  >>> from moe_jax.contiguous_experts import ContiguousExperts
  >>> experts = ContiguousExperts(gemm="xla", recipe=Fp8Training())
  >>> x = jnp.ones((2, 128), jnp.bfloat16); w1 = jnp.full((2, 256, 128), 0.01, jnp.bfloat16)
  >>> w2 = jnp.full((2, 128, 128), 0.01, jnp.bfloat16); ids = jnp.array([[0], [1]])
  >>> loss = lambda w1: fused_moe(x, w1, w2, jnp.ones((2, 1)), ids, experts=experts).sum()
  >>> jax.grad(loss)(w1).dtype
  dtype(bfloat16)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax import grouped_gemm, grouped_gemm_backward, quant
from moe_jax.registry import AUTO

BLOCK = 128


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Training:
    """DeepSeek-V3's FP8 recipe for the expert GEMMs (module docstring).

    Attributes:
      quant_impl: implementation of the 1x128 quantization of activations and output gradients
        (`moe_jax.act_quant.GROUP_QUANTS`: "auto", "xla", "pallas").
    """

    quant_impl: str = AUTO

    def quantize(self, w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """`quantize_blocks(w)`: what the GEMM and its dgrad read of master weights w."""
        return quantize_blocks(w)

    def check(self, *, hidden: int, intermediate: int, w_dtype) -> None:
        """Raises when the recipe cannot run these weights."""
        if jnp.dtype(w_dtype) == quant.FP8_DTYPE:
            raise TypeError(
                "Fp8Training quantizes float master weights on the fly, but the weights are "
                "already float8_e4m3fn: pass bf16/float32 weights (or drop recipe= to run the "
                "FP8 inference path)"
            )
        if hidden % BLOCK or intermediate % BLOCK:
            raise ValueError(
                f"Fp8Training needs H and I to be multiples of {BLOCK}: H={hidden}, "
                f"I={intermediate}"
            )


def grouped_gemm_contiguous(
    backend: grouped_gemm.GroupedGemm,
    x: jax.Array,
    w: jax.Array,
    expert_ids: jax.Array,
    expert_ends: jax.Array,
    *,
    recipe: Fp8Training,
    alignment: int,
    out_dtype: jnp.dtype,
    wgrad=AUTO,
    dgrad: grouped_gemm.GroupedGemm | None = None,
) -> jax.Array:
    """y [M, N] = FP8(x) [M, K] @ FP8(w)[expert].T with the recipe's backward.

    Args:
      backend: a `GroupedGemm` that runs the FP8 problem.
      x: bf16/float32[M, K] rows in the contiguous layout; K a multiple of 128.
      w: bf16/float32[E, N, K] master weights; N and K multiples of 128.
      expert_ids, expert_ends: the layout's (see `moe_jax.grouped_gemm`).
      recipe: the `Fp8Training` options.
      alignment: the layout's segment multiple.
      out_dtype: dtype of y.
      wgrad: `moe_jax.grouped_gemm_backward.WGRADS` choice.
      dgrad: the dgrad's `GroupedGemm` (None: `moe_jax.plan.dgrad_gemm`'s).

    Returns:
      [M, N] in `out_dtype`; padding rows unspecified.
    """
    for name, a in (("x", x), ("w", w)):
        if not jnp.issubdtype(a.dtype, jnp.floating) or jnp.dtype(a.dtype).itemsize < 2:
            raise TypeError(
                f"{name}.dtype={a.dtype} but the recipe quantizes bf16/float16/float32 operands "
                f"itself (its dw would be {a.dtype}); for FP8 weights with their scales, drop "
                "recipe= and run the FP8 inference path"
            )
    return grouped_gemm_backward.grouped_gemm_contiguous(
        backend,
        x,
        w,
        expert_ids,
        expert_ends,
        alignment=alignment,
        out_dtype=out_dtype,
        wgrad=wgrad,
        dgrad=dgrad,
        recipe=recipe,
    )


def quantize_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """128x128 block FP8 of w [E, N, K] and of its transpose [E, K, N], from one read of w.

    `quant.per_block_quant_fp8`'s formula, with the division left to XLA (it may multiply by
    the reciprocal: a last-bit difference). N and K must be multiples of 128.

    Returns:
      (wq float8_e4m3fn[E, N, K], scales float32[E, N/128, K/128], the transpose of wq
      [E, K, N], the transposed scales [E, K/128, N/128]).
    """
    if w.ndim != 3 or w.shape[1] % BLOCK or w.shape[2] % BLOCK:
        raise ValueError(f"{w.shape=} but [E, N, K] with N and K multiples of {BLOCK} is needed")
    num_experts, n, k = w.shape
    tiles = w.astype(jnp.float32).reshape(num_experts, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    amax = jnp.max(jnp.abs(tiles), axis=(2, 4), keepdims=True)
    scales = jnp.maximum(amax, quant.SCALE_EPS) / quant.FP8_MAX
    q = jnp.clip(tiles / scales, -quant.FP8_MAX, quant.FP8_MAX).astype(quant.FP8_DTYPE)
    wq = q.reshape(num_experts, n, k)
    s = scales[:, :, 0, :, 0]
    return wq, s, jnp.swapaxes(wq, 1, 2), jnp.swapaxes(s, 1, 2)
