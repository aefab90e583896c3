"""Pallas GPU kernel: act(gate) * up, then per-token-group FP8 quantization, in one pass.

Between the two grouped GEMMs of the FP8 pipeline, the bf16 [M, 2I] output of GEMM1 becomes the
FP8 [M, I] input of GEMM2 plus float32 scales [M, I / 128]. Unfused this reads [M, 2I], writes and
re-reads [M, I] bf16, and writes [M, I] FP8; fused it reads [M, 2I] once and writes only the FP8
rows and the scales. One program handles `block_m` rows of one 128-column group: it loads the gate
columns [g*128, (g+1)*128) and the up columns [I + g*128, ...), so the group's amax never leaves
registers.

Rounding matches `moe_jax.activation.act_and_mul` followed by
`moe_jax.quant.per_token_group_quant_fp8`: act in float32, rounded to the input dtype, the product
rounded again, then `scale = max(amax, 1e-10) / 448` and `q = clip(a / scale, +-448)` cast to
e4m3 with round-to-nearest-even.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from moe_jax import quant
from moe_jax.activation import act_and_mul, check_activation, gated_activation, round_to_dtype
from moe_jax.kernels import _triton


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActQuantConfig:
    """Tunables of the fused activation + quantization kernel.

    Attributes:
      block_m: rows per program (power of two).
      num_warps: Triton warps per program.
    """

    block_m: int = 32
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_m", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"ActQuantConfig.{name}={value} but a power of two is needed")


def heuristic_config(num_rows: int) -> ActQuantConfig:
    """32 rows x 128 columns per program (8 KiB of bf16 in, 4 KiB of FP8 out)."""
    return ActQuantConfig(block_m=min(32, _triton.next_power_of_2(max(num_rows, 1))))


def _act_quant_kernel(
    # inputs
    gate_ref,
    up_ref,
    # outputs
    q_ref,
    scale_ref,
    *,
    activation: str,
    interpret: bool,
):
    # Triton rounds exactly on a cast; XLA (interpret mode) needs the explicit rounding.
    round_fn = round_to_dtype if interpret else (lambda x, dtype: x.astype(dtype))
    a = gated_activation(gate_ref[...], up_ref[...], activation, round_fn=round_fn)
    a = a.astype(jnp.float32)
    amax = jnp.max(jnp.abs(a), axis=1, keepdims=True)
    scale = jnp.maximum(amax, quant.SCALE_EPS) / quant.FP8_MAX
    q_ref[...] = jnp.clip(a / scale, -quant.FP8_MAX, quant.FP8_MAX).astype(q_ref.dtype)
    scale_ref[...] = scale


def act_and_quant(
    h: jax.Array,
    *,
    activation: str = "silu",
    group_size: int = 128,
    config: ActQuantConfig | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """act(h[:, :I]) * h[:, I:] quantized to FP8 per row per `group_size` columns.

    Args:
      h: bf16/float16/float32[M, 2I] output of the first GEMM; I a multiple of `group_size`.
      activation: "silu" or "gelu".
      group_size: columns per scale (128, vLLM's block recipe).
      config: block sizes; None picks `heuristic_config(M)`.
      interpret: run in Pallas interpret mode (CPU tests).

    Returns:
      (q float8_e4m3fn[M, I], scales float32[M, I // group_size]).
    """
    check_activation(activation)
    if h.ndim != 2 or h.shape[1] % (2 * group_size):
        raise ValueError(f"h.shape={h.shape} but [M, 2I] with I a multiple of {group_size=}")
    if h.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise TypeError(f"h.dtype={h.dtype} but bfloat16, float16 or float32 is needed")
    num_rows, two_i = h.shape
    inter = two_i // 2
    num_groups = inter // group_size
    if num_rows == 0:
        return jnp.zeros((0, inter), quant.FP8_DTYPE), jnp.zeros((0, num_groups), jnp.float32)
    cfg = heuristic_config(num_rows) if config is None else config
    padded_rows = -(-num_rows // cfg.block_m) * cfg.block_m
    if padded_rows != num_rows:
        h = jnp.pad(h, ((0, padded_rows - num_rows), (0, 0)))
    block = (cfg.block_m, group_size)
    with _triton.quiet_triton_deprecation():
        q, scales = pl.pallas_call(
            functools.partial(_act_quant_kernel, activation=activation, interpret=interpret),
            out_shape=(
                jax.ShapeDtypeStruct((padded_rows, inter), quant.FP8_DTYPE),
                jax.ShapeDtypeStruct((padded_rows, num_groups), jnp.float32),
            ),
            grid=(padded_rows // cfg.block_m, num_groups),
            in_specs=[
                pl.BlockSpec(block, lambda i, g: (i, g)),
                pl.BlockSpec(block, lambda i, g: (i, g + num_groups)),
            ],
            out_specs=[
                pl.BlockSpec(block, lambda i, g: (i, g)),
                pl.BlockSpec((cfg.block_m, 1), lambda i, g: (i, g)),
            ],
            compiler_params=_triton.compiler_params(num_warps=cfg.num_warps, num_stages=1),
            interpret=interpret,
            name=f"act_quant_{activation}_bm{cfg.block_m}_w{cfg.num_warps}",
        )(h, h)
    return q[:num_rows], scales[:num_rows]


def act_and_quant_reference(
    h: jax.Array, *, activation: str = "silu", group_size: int = 128
) -> tuple[jax.Array, jax.Array]:
    """Pure-JAX reference of `act_and_quant` (same signature minus tuning)."""
    return quant.per_token_group_quant_fp8(act_and_mul(h, activation), group_size)
