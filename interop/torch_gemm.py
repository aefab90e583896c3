"""Grouped-GEMM backend "torch": `torch._grouped_mm` called from `jax.jit` through the bridge.

- contiguous: `torch._grouped_mm(x, w.mT, offs=expert_ends)`; rows of expert e are
  [expert_ends[e-1], expert_ends[e]), padding rows included (they are zero, so their outputs are
  zero; rows past expert_ends[-1] are left as torch leaves them). torch returns a new tensor, which
  is copied into XLA's output buffer: this backend costs one extra [M, N] copy.
- masked: `torch.bmm(x, w.mT, out=...)` writes straight into XLA's buffer (every row is computed;
  rows past num_rows_per_expert are unspecified by the contract).

FP8 operands are dequantized in JAX first (to bfloat16 on the GPU, float32 on the CPU): this is a
fallback that needs no FP8 kernel, not a fast FP8 path (use "deep_gemm"). On the GPU torch's grouped
GEMM takes bfloat16 only, so float32 problems are refused there. On the CPU, torch 2.13's
`_grouped_mm` handles bfloat16 and float32, which lets CI run the whole bridge.

Also registered here: the "torch" weight gradient of `moe_jax.grouped_gemm_backward.WGRADS`,
`torch._grouped_mm(dy.T [N, M], x [M, K], offs=expert_ends)` -> [E, N, K], the 2-D x 2-D form that
groups along the shared token dimension (segment offsets stay on the device: no host sync).
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp

from moe_jax import grouped_gemm, grouped_gemm_backward
from moe_jax.interop import bridge
from moe_jax.registry import current_platform

_GPU_DTYPES = ("bfloat16", "float8_e4m3fn")
_CPU_DTYPES = ("bfloat16", "float32", "float8_e4m3fn")


def _contiguous_fn(out, x, w, expert_ends):
    torch = bridge.import_torch()
    out.copy_(torch._grouped_mm(x, w.transpose(-2, -1), offs=expert_ends))


def _wgrad_fn(zero_empty_groups, out, dy, x, expert_ends):
    torch = bridge.import_torch()
    dw = torch._grouped_mm(dy.transpose(0, 1), x, offs=expert_ends)
    if zero_empty_groups:
        is_empty = torch.diff(expert_ends, prepend=expert_ends.new_zeros(1)) == 0
        dw.masked_fill_(is_empty[:, None, None], 0)
    out.copy_(dw)


def _zero_empty_groups() -> bool:
    """Whether the wgrad must zero experts with no rows itself.

    On sm_90 and on the CPU torch writes zeros for an empty group. On sm_100 it does not
    (pytorch/pytorch#172439, open 2026-01): there the result is masked, one more pass over dw.
    Drop this once that issue is fixed.
    """
    if current_platform() != "gpu":
        return False
    return getattr(jax.devices()[0], "compute_capability", "9.0") != "9.0"


def _dgrad_fn(out, dy, w, expert_ends):
    torch = bridge.import_torch()
    out.copy_(torch._grouped_mm(dy, w, offs=expert_ends))


def _masked_fn(out, x, w):
    torch = bridge.import_torch()
    if out.dtype == x.dtype:
        torch.bmm(x, w.transpose(-2, -1), out=out)
    else:
        out.copy_(torch.bmm(x, w.transpose(-2, -1)))


class TorchGemm(grouped_gemm.GroupedGemm):
    """torch's grouped GEMM through the DLPack bridge (GPU: bfloat16; CPU: bfloat16/float32)."""

    name = "torch"

    def unsupported_reason(self, problem: grouped_gemm.GemmProblem) -> str | None:
        if problem.layout not in grouped_gemm.LAYOUTS:
            return f"layout {problem.layout!r} is not one of {grouped_gemm.LAYOUTS}"
        if importlib.util.find_spec("torch") is None:
            return f"torch is not installed: {bridge.TORCH_INSTALL_HINT}"
        if problem.platform == "gpu":
            dtypes = _GPU_DTYPES
        elif problem.platform == "cpu":
            dtypes = _CPU_DTYPES
        else:
            return f"platform {problem.platform!r} is not cpu or gpu"
        for dtype in (problem.x_dtype, problem.w_dtype):
            if dtype not in dtypes:
                return f"dtype {dtype} is not one of {dtypes} on {problem.platform}"
        if problem.layout == "masked" and problem.platform == "cpu":  # torch.bmm: any row length
            return None
        # torch's grouped GEMM takes rows of whole 16-byte units on the CPU as on the GPU (and the
        # GPU path keeps that rule for both layouts); FP8 operands reach it dequantized to bf16
        # (GPU) or float32 (CPU)
        itemsize = 2 if problem.platform == "gpu" else 4
        for dtype in (problem.x_dtype, problem.w_dtype):
            if dtype in ("bfloat16", "float16"):
                itemsize = min(itemsize, 2)
        if (problem.k * itemsize) % 16 or (problem.n * itemsize) % 16:
            return (
                f"{problem.k=} and {problem.n=}: torch's grouped GEMM needs rows of whole 16-byte "
                f"units ({16 // itemsize} {'bf16' if itemsize == 2 else 'float32'} elements)"
            )
        return None

    def contiguous(
        self, x, w, expert_ids, expert_ends, *, x_scales=None, w_scales=None, alignment, out_dtype
    ):
        del expert_ids, alignment  # segments come from expert_ends; padding rows are zero
        _check_operands(x, w, x_scales, w_scales, rows_axis=0)
        num_rows, n = x.shape[0], w.shape[1]
        if num_rows == 0 or w.shape[0] == 0:
            return jnp.zeros((num_rows, n), out_dtype)
        a, b = _compute_operands(x, w, x_scales, w_scales)
        call = bridge.torch_callback(_contiguous_fn, jax.ShapeDtypeStruct((num_rows, n), out_dtype))
        return call(a, b, expert_ends.astype(jnp.int32))

    def contiguous_dgrad(self, dy, w, expert_ids, expert_ends, *, alignment, out_dtype):
        """dy [M, N] @ w[e] [N, K] with w as stored (torch reads it N-major): no transpose."""
        del expert_ids, alignment
        _check_operands(dy, jnp.swapaxes(w, 1, 2), None, None, rows_axis=0)
        num_rows, k = dy.shape[0], w.shape[2]
        if num_rows == 0 or w.shape[0] == 0:
            return jnp.zeros((num_rows, k), out_dtype)
        a, b = _compute_operands(dy, w, None, None)
        call = bridge.torch_callback(_dgrad_fn, jax.ShapeDtypeStruct((num_rows, k), out_dtype))
        return call(a, b, expert_ends.astype(jnp.int32))

    def masked(
        self, x, w, num_rows_per_expert, *, x_scales=None, w_scales=None, expected_m=None, out_dtype
    ):
        del num_rows_per_expert, expected_m  # every row is computed; no scheduling hint needed
        _check_operands(x, w, x_scales, w_scales, rows_axis=1)
        num_groups, max_m, n = x.shape[0], x.shape[1], w.shape[1]
        if max_m == 0 or num_groups == 0:
            return jnp.zeros((num_groups, max_m, n), out_dtype)
        a, b = _compute_operands(x, w, x_scales, w_scales)
        call = bridge.torch_callback(
            _masked_fn, jax.ShapeDtypeStruct((num_groups, max_m, n), out_dtype)
        )
        return call(a, b)


def _check_operands(x, w, x_scales, w_scales, *, rows_axis: int) -> None:
    if w.ndim != 3:
        raise ValueError(f"{w.shape=}: expected [E, N, K]")
    if x.ndim != rows_axis + 2 or x.shape[-1] != w.shape[2]:
        raise ValueError(f"{x.shape=} and {w.shape=}: x needs {rows_axis + 2} dims ending in K")
    if rows_axis == 1 and x.shape[0] != w.shape[0]:
        raise ValueError(f"{x.shape=} and {w.shape=}: masked x needs E groups")
    if x.dtype == jnp.float8_e4m3fn and x_scales is None:
        raise ValueError(f"{x.dtype=} needs x_scales (per_token_group_quant_fp8)")
    if w.dtype == jnp.float8_e4m3fn and w_scales is None:
        raise ValueError(f"{w.dtype=} needs w_scales (per_block_quant_fp8)")


def _compute_operands(x, w, x_scales, w_scales) -> tuple[jax.Array, jax.Array]:
    """Both operands in one dtype torch's grouped GEMM takes; FP8 is dequantized in JAX."""
    a = grouped_gemm.dequant_rows(x, x_scales)
    b = grouped_gemm.dequant_weights(w, w_scales)
    if current_platform() == "gpu":
        compute = jnp.bfloat16
    else:
        compute = jnp.promote_types(a.dtype, b.dtype)
    return a.astype(compute), b.astype(compute)


class TorchWgrad:
    """Grouped weight gradient dw [E, N, K] = dy_e^T x_e through `torch._grouped_mm` (2-D x 2-D).

    GPU: bfloat16 operands (float32 accumulation inside, bf16 result); CPU: bfloat16/float32.
    """

    name = "torch"

    def unsupported_reason(self, problem: grouped_gemm.GemmProblem) -> str | None:
        if problem.layout != "contiguous":
            return f"layout {problem.layout!r}: the grouped wgrad runs on the contiguous layout"
        if importlib.util.find_spec("torch") is None:
            return f"torch is not installed: {bridge.TORCH_INSTALL_HINT}"
        if problem.k % 8 or problem.n % 8 or (problem.alignment or 0) % 8:
            return (
                f"{problem.n=}, {problem.k=} and {problem.alignment=} must be multiples of 8 "
                "(torch's grouped GEMM needs 16-byte strides)"
            )
        if problem.platform == "gpu":
            if problem.x_dtype != "bfloat16" or problem.w_dtype != "bfloat16":
                return f"dtypes {problem.x_dtype}, {problem.w_dtype}: bfloat16 only on GPU"
        elif problem.platform == "cpu":
            for dtype in (problem.x_dtype, problem.w_dtype):
                if dtype not in ("bfloat16", "float32"):
                    return f"dtype {dtype} is not bfloat16 or float32"
        else:
            return f"platform {problem.platform!r} is not cpu or gpu"
        return None

    def __call__(self, dy, x, expert_ids, expert_ends, *, num_experts, alignment, out_dtype):
        del expert_ids, alignment  # groups come from expert_ends; padding rows are zero
        n, k = dy.shape[1], x.shape[1]
        if num_experts == 0 or dy.shape[0] == 0:
            return jnp.zeros((num_experts, n, k), out_dtype)
        compute = jnp.promote_types(dy.dtype, x.dtype)
        call = bridge.torch_callback(
            functools.partial(_wgrad_fn, _zero_empty_groups()),
            jax.ShapeDtypeStruct((num_experts, n, k), out_dtype),
        )
        return call(dy.astype(compute), x.astype(compute), expert_ends.astype(jnp.int32))


grouped_gemm.GEMMS.register(TorchGemm())
grouped_gemm_backward.WGRADS.register(TorchWgrad())
