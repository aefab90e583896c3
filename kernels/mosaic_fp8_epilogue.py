"""The fused GEMM1 tile's epilogue in the Mosaic GPU FP8 kernel: act(gate) * up, quantized to FP8.

`store_act_quant` runs inside `kernels.mosaic_fp8_kernel`'s compute warpgroups at the end of
each gated tile (`kernels.mosaic_fp8_gemm.mosaic_fp8_gemm_act_quant_contiguous`): GEMM1's bf16
gate and up halves never leave the chip; only the FP8 codes and their per-row scales do, in
`kernels.act_quant.act_and_quant`'s roundings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax import quant
from moe_jax.activation import gated_activation, round_to_dtype
from moe_jax.kernels.act_quant import KERNEL_ACTIVATIONS


def store_act_quant(
    acc: jax.Array,
    wg: jax.Array,
    rows,
    column_tile: jax.Array,
    outputs,
    scratch: dict,
    activation: str,
    interpret: bool,
) -> None:
    """The gated tile's epilogue: act(gate) * up of the tile's bf16 GEMM1 outputs, quantized.

    Both compute warpgroups share it. Each stores its bf16 [64, 128] half (warpgroup 0 the
    gate, 1 the up columns) to shared memory; once both have (the epilogue barrier's first
    completion of the tile) warpgroup w takes columns [64w, 64w + 64) of both and computes, in
    `kernels.act_quant`'s roundings,

        a = bf16(bf16(act(gate)) * up)        float32 arithmetic
        amax_w[r] = max_c |a[r, c]|           over its 64 columns

    then, once both row maxima are in shared memory (the barrier's second completion),

        scale[r] = max(amax_0[r], amax_1[r], 1e-10) / 448
        q[r, c] = e4m3(a[r, c] / scale[r])    round to nearest even, saturating

    and stores its [64, 64] block of q at (`rows`, group `column_tile`) by TMA; warpgroup 0 also
    stores the 64 scales at scales[column_tile, rows] (group-major). A warpgroup writes the next
    tile's halves only after passing this tile's second completion, which both reach after
    loading their columns, so one buffer serves every tile.

    Args:
      acc: float32 [64, 128] this warpgroup's sum for the tile (gate or up columns).
      wg: this compute warpgroup's index (0: gate, 1: up).
      rows: the tile's 64 rows of the layout (a `pl.ds`).
      column_tile: the tile's quantization group (128 columns of act(gate) * up).
      outputs: (q float8_e4m3fn [M, I], scales float32 [I/128, M]) in global memory.
      scratch: the kernel's shared memory: "h_smem" bf16 [2, 64, 128], "row_smem" float32
        [3, 64], "q_smem" float8_e4m3fn [2, 64, 64] and "epilogue_barrier" (2 arrivals).
      activation: a name in `moe_jax.activation.ACTIVATIONS`.
      interpret: interpret mode's roundings (`round_to_dtype`, `quant.divide`, the clip).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    q_gmem, scales_gmem = outputs
    h_smem, row_smem, q_smem = scratch["h_smem"], scratch["row_smem"], scratch["q_smem"]
    round_fn = round_to_dtype if interpret else (lambda value, dtype: value.astype(dtype))
    h_smem[wg] = round_fn(acc, jnp.bfloat16)  # GEMM1's output dtype
    both_wgs = scratch["epilogue_barrier"]
    plgpu.barrier_arrive(both_wgs)  # this tile's halves
    plgpu.barrier_wait(both_wgs)
    width = h_smem.shape[2] // 2
    columns = pl.ds(wg * width, width)
    gate, up = h_smem[0, :, columns], h_smem[1, :, columns]
    act_fn = None if interpret else KERNEL_ACTIVATIONS.get(activation)
    a = gated_activation(gate, up, activation, round_fn=round_fn, act_fn=act_fn)
    a = a.astype(jnp.float32)
    row_smem[wg] = jnp.max(jnp.abs(a), axis=1)
    plgpu.barrier_arrive(both_wgs)  # this tile's row maxima
    plgpu.barrier_wait(both_wgs)
    amax = jnp.maximum(row_smem[0], row_smem[1])
    # interpret mode: XLA would rewrite a / broadcast(b) as a * (1 / b), which `quant.divide`
    # prevents. Compiled, Mosaic GPU's float32 division is not correctly rounded (its scales sit
    # an ulp from the Pallas kernel's in about half the rows on the H200) and its e4m3 cast
    # saturates (cvt.satfinite), so the clip is interpret mode's only.
    divide = quant.divide if interpret else (lambda num, den: num / den)
    scale = divide(jnp.maximum(amax, quant.SCALE_EPS), jnp.float32(quant.FP8_MAX))
    quotient = divide(a, jax.lax.broadcast_in_dim(scale, a.shape, (0,)))
    if interpret:
        quotient = jnp.clip(quotient, -quant.FP8_MAX, quant.FP8_MAX)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this warpgroup's last tile's copies
    q_smem[wg] = quotient.astype(q_smem.dtype)

    @pl.when(wg == 0)
    def _scales():
        row_smem[2] = scale

    plgpu.commit_smem()
    q_columns = pl.ds(column_tile * 2 * width + wg * width, width)
    plgpu.copy_smem_to_gmem(q_smem.at[wg], q_gmem.at[rows, q_columns])

    @pl.when(wg == 0)
    def _store_scales():
        plgpu.copy_smem_to_gmem(row_smem.at[2], scales_gmem.at[column_tile, rows])
