"""Grouped-GEMM backend "deep_gemm": DeepGEMM's grouped GEMMs called from `jax.jit` via the bridge.

- FP8 weights: `m_grouped_fp8_gemm_nt_contiguous(a, b, d, grouped_layout)` on the contiguous layout
  (grouped_layout = expert_ids, int32, -1 on padding rows, segments aligned to 128 rows; DeepGEMM
  skips padding blocks) and `m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, expected_m)` on the
  masked one. bfloat16 activations are quantized per token group in JAX first.
- bfloat16 weights: `m_grouped_bf16_gemm_nt_contiguous` / `m_grouped_bf16_gemm_nt_masked`.

Activation scales. moe_jax carries them row-major, float32 [M, K/128]. DeepGEMM on sm_90 wants them
MN-major and TMA-aligned: strides (1, align(M, 4)), i.e. the transpose, each column padded to a
16-byte multiple; otherwise it allocates a copy and runs a transpose kernel on every call. So the
transpose happens in XLA (`mn_major_scales`: [K/128, align(M, 4)], zero padded), and the torch side
passes the strided view `sfa_t.as_strided((M, K/128), (1, align(M, 4)))`, for which DeepGEMM's
`get_mn_major_tma_aligned_tensor` returns its input as is. Worked example, M=6, K=256:

    x_scales [6, 2]   ->  sfa_t [2, 8] = [[s00 s10 s20 s30 s40 s50 0 0],
                                          [s01 s11 s21 s31 s41 s51 0 0]]
    view [6, 2], strides (1, 8): view[m, kb] = sfa_t[kb, m] = x_scales[m, kb]

DeepGEMM's outputs are bfloat16; another `out_dtype` is a cast in JAX afterwards. Library names are
resolved with fallbacks to older releases (see `_NAMES`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
from typing import Any

import jax
import jax.numpy as jnp

from moe_jax import grouped_gemm, quant
from moe_jax.interop import bridge

BLOCK = 128  # DeepGEMM's scale granularity and contiguous-layout row alignment on sm_90/sm_100
MASKED_MIN_ROWS = 128  # the shortest masked block DeepGEMM gets (see DeepGemm.masked)
SUPPORTED_ARCHS = ("9.0", "10.0")
INSTALL_HINT = (
    "install DeepGEMM with `pip install 'moe_jax[gpu]'` (PyPI deepinfer-gemm, import name "
    "deep_gemm), an sdist built against your torch: it needs nvcc, torch importable at build time "
    "(--no-build-isolation), libdw/libelf headers on CPLUS_INCLUDE_PATH and a system g++ "
    "(CXX=/usr/bin/g++)"
)
# Current name first, then the names older DeepGEMM releases used.
_NAMES = {
    "fp8_contiguous": (
        "m_grouped_fp8_gemm_nt_contiguous",
        "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
    ),
    "fp8_masked": (
        "m_grouped_fp8_gemm_nt_masked",
        "fp8_m_grouped_gemm_nt_masked",
        "m_grouped_gemm_fp8_fp8_bf16_nt_masked",
    ),
    "bf16_contiguous": ("m_grouped_bf16_gemm_nt_contiguous",),
    "bf16_contiguous_nn": ("m_grouped_bf16_gemm_nn_contiguous",),
    "bf16_masked": ("m_grouped_bf16_gemm_nt_masked",),
}
_FP8 = "float8_e4m3fn"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepGemmConfig:
    """Options of the DeepGEMM backend.

    Attributes:
      command_buffer_compatible: let XLA capture the DeepGEMM call into a CUDA graph, so replays
        skip Python. Safe on sm_90 with FP32 scales (the call then allocates nothing and reads
        nothing on the host); every shape must have been JIT-compiled by DeepGEMM before the
        first capture. Needs XLA to build command buffers for small programs
        (`--xla_gpu_graph_min_graph_size`) to make a difference.
    """

    command_buffer_compatible: bool = False


def mn_major_scales(x_scales: jax.Array) -> jax.Array:
    """Row-major activation scales to DeepGEMM's MN-major, TMA-aligned storage.

    Args:
      x_scales: float32[..., M, G] scales per row per 128 columns (`per_token_group_quant_fp8`).

    Returns:
      float32[..., G, align(M, 4)]: the transpose, each row zero padded to a 16-byte multiple.
      `tma_aligned_view` turns it back into an [..., M, G] view on the torch side.

    Example:
      >>> mn_major_scales(jnp.arange(6.0).reshape(3, 2)).tolist()
      [[0.0, 2.0, 4.0, 0.0], [1.0, 3.0, 5.0, 0.0]]
    """
    num_rows = x_scales.shape[-2]
    padded = -(-num_rows // 4) * 4
    transposed = jnp.swapaxes(x_scales.astype(jnp.float32), -1, -2)
    pad = [(0, 0)] * (x_scales.ndim - 1) + [(0, padded - num_rows)]
    return jnp.pad(transposed, pad)


def tma_aligned_view(sfa_t: Any, num_rows: int) -> Any:
    """Torch [..., M, G] view of `mn_major_scales` storage, strides (..., 1, align(M, 4))."""
    *lead, groups, padded = sfa_t.shape
    if not lead:
        return sfa_t.as_strided((num_rows, groups), (1, padded))
    return sfa_t.as_strided((lead[0], num_rows, groups), (groups * padded, 1, padded))


@functools.cache
def _library() -> tuple[Any, str | None]:
    """(deep_gemm module or None, why it cannot be used)."""
    if importlib.util.find_spec("torch") is None:
        return None, f"torch is not installed: {bridge.TORCH_INSTALL_HINT}"
    if importlib.util.find_spec("deep_gemm") is None:
        return None, f"deep_gemm is not importable: {INSTALL_HINT}"
    try:
        return importlib.import_module("deep_gemm"), None
    except Exception as e:  # a broken build raises anything from ImportError to OSError
        return None, f"import deep_gemm failed ({type(e).__name__}: {e}); {INSTALL_HINT}"


def _resolve(kind: str):
    module, why = _library()
    if module is None:
        raise RuntimeError(why)
    for name in _NAMES[kind]:
        if (fn := getattr(module, name, None)) is not None:
            return fn
    raise RuntimeError(
        f"deep_gemm {getattr(module, '__version__', '?')} has none of {_NAMES[kind]}"
    )


def _gpu_arch() -> str | None:
    try:
        return getattr(jax.devices("gpu")[0], "compute_capability", None)
    except RuntimeError:
        return None


class DeepGemm(grouped_gemm.GroupedGemm):
    """DeepGEMM FP8 (block-scaled) and bfloat16 grouped GEMMs on sm_90 / sm_100."""

    name = "deep_gemm"
    is_scales_group_major = True  # `mn_major_scales` transposes them

    def __init__(self, config: DeepGemmConfig | None = None):
        self.config = DeepGemmConfig() if config is None else config

    def unsupported_reason(self, problem: grouped_gemm.GemmProblem) -> str | None:
        if problem.layout not in grouped_gemm.LAYOUTS:
            return f"layout {problem.layout!r} is not one of {grouped_gemm.LAYOUTS}"
        if problem.platform != "gpu":
            return f"DeepGEMM runs on NVIDIA GPUs only, not on platform {problem.platform!r}"
        if (why := _library()[1]) is not None:
            return why
        if (arch := _gpu_arch()) not in SUPPORTED_ARCHS:
            return f"GPU compute capability {arch} is not one of {SUPPORTED_ARCHS} (sm_90, sm_100)"
        pair = (problem.x_dtype, problem.w_dtype)
        if pair not in ((_FP8, _FP8), ("bfloat16", _FP8), ("bfloat16", "bfloat16")):
            return (
                f"dtypes x={problem.x_dtype}, w={problem.w_dtype}: DeepGEMM takes FP8 weights "
                "(with FP8 or bfloat16 activations) or bfloat16 for both"
            )
        if problem.n % BLOCK or problem.k % BLOCK:
            return f"{problem.n=} and {problem.k=} must be multiples of {BLOCK}"
        if problem.layout == "contiguous" and problem.alignment not in (None, BLOCK):
            return (
                f"{problem.alignment=} but DeepGEMM's contiguous layout needs {BLOCK}-row segments"
            )
        return None

    def contiguous(
        self, x, w, expert_ids, expert_ends, *, x_scales=None, w_scales=None, alignment, out_dtype
    ):
        del expert_ends  # DeepGEMM reads the expert of every row from expert_ids
        num_rows, n = x.shape[0], w.shape[1]
        _check_operands(x, w, x_scales, w_scales, grouped_rows=False)
        if expert_ids.shape != (num_rows,):
            raise ValueError(f"{expert_ids.shape=} but {x.shape=}: need one id per row")
        if alignment != BLOCK or num_rows % BLOCK:
            raise ValueError(
                f"{alignment=}, {x.shape=}: DeepGEMM needs {BLOCK}-row aligned segments"
            )
        if num_rows == 0:
            return jnp.zeros((0, n), out_dtype)
        out = jax.ShapeDtypeStruct((num_rows, n), jnp.bfloat16)
        expert_ids = expert_ids.astype(jnp.int32)
        cmd = self.config.command_buffer_compatible
        if w.dtype == quant.FP8_DTYPE:
            x, x_scales = _fp8_activations(x, x_scales)
            fn = functools.partial(_fp8_contiguous, _resolve("fp8_contiguous"), num_rows)
            args = (x, mn_major_scales(x_scales), w, w_scales.astype(jnp.float32), expert_ids)
        else:
            fn = functools.partial(_bf16_contiguous, _resolve("bf16_contiguous"))
            args = (x, w, expert_ids)
        y = bridge.torch_callback(fn, out, command_buffer_compatible=cmd)(*args)
        return y.astype(out_dtype)

    def contiguous_dgrad(self, dy, w, expert_ids, expert_ends, *, alignment, out_dtype):
        """dy [M, N] @ w[e] [N, K]: `m_grouped_bf16_gemm_nn_contiguous` on w as stored (bf16
        weights; no transpose). FP8 weights take the base class's transposed NT call."""
        if w.dtype != jnp.bfloat16:
            return super().contiguous_dgrad(
                dy, w, expert_ids, expert_ends, alignment=alignment, out_dtype=out_dtype
            )
        num_rows, k = dy.shape[0], w.shape[2]
        _check_operands(dy, jnp.swapaxes(w, 1, 2), None, None, grouped_rows=False)
        if alignment != BLOCK or num_rows % BLOCK:
            raise ValueError(
                f"{alignment=}, {dy.shape=}: DeepGEMM needs {BLOCK}-row aligned segments"
            )
        if num_rows == 0:
            return jnp.zeros((0, k), out_dtype)
        fn = functools.partial(_bf16_contiguous, _resolve("bf16_contiguous_nn"))
        out = jax.ShapeDtypeStruct((num_rows, k), jnp.bfloat16)
        cmd = self.config.command_buffer_compatible
        y = bridge.torch_callback(fn, out, command_buffer_compatible=cmd)(
            dy, w, expert_ids.astype(jnp.int32)
        )
        return y.astype(out_dtype)

    def masked(
        self, x, w, num_rows_per_expert, *, x_scales=None, w_scales=None, expected_m=None, out_dtype
    ):
        num_groups, max_m, n = x.shape[0], x.shape[1], w.shape[1]
        _check_operands(x, w, x_scales, w_scales, grouped_rows=True)
        if num_rows_per_expert.shape != (num_groups,):
            raise ValueError(f"{num_rows_per_expert.shape=} but {x.shape=}: need E counts")
        if max_m == 0:
            return jnp.zeros((num_groups, 0, n), out_dtype)
        if max_m < MASKED_MIN_ROWS:
            # DeepGEMM 2.8.2's masked kernels give wrong rows for max_m below 128 (1, 8, 32
            # seen): shorter blocks run padded to MASKED_MIN_ROWS zero rows and are cut back.
            pad = [(0, 0), (0, MASKED_MIN_ROWS - max_m), (0, 0)]
            y = self.masked(
                jnp.pad(x, pad),
                w,
                num_rows_per_expert,
                x_scales=None if x_scales is None else jnp.pad(x_scales, pad),
                w_scales=w_scales,
                expected_m=expected_m,
                out_dtype=out_dtype,
            )
            return y[:, :max_m]
        expected_m = max_m if expected_m is None else int(expected_m)
        if expected_m <= 0:
            raise ValueError(f"{expected_m=} must be positive (a hint of rows per expert)")
        out = jax.ShapeDtypeStruct((num_groups, max_m, n), jnp.bfloat16)
        masked_m = num_rows_per_expert.astype(jnp.int32)
        cmd = self.config.command_buffer_compatible
        if w.dtype == quant.FP8_DTYPE:
            x, x_scales = _fp8_activations(x, x_scales)
            fn = functools.partial(_fp8_masked, _resolve("fp8_masked"), max_m, expected_m)
            args = (x, mn_major_scales(x_scales), w, w_scales.astype(jnp.float32), masked_m)
        else:
            fn = functools.partial(_bf16_masked, _resolve("bf16_masked"), expected_m)
            args = (x, w, masked_m)
        y = bridge.torch_callback(fn, out, command_buffer_compatible=cmd)(*args)
        return y.astype(out_dtype)


# Callback bodies: run on XLA's stream with torch tensors aliasing XLA buffers; no allocation.
def _fp8_contiguous(gemm, num_rows, d, x, sfa_t, w, w_scales, expert_ids):
    gemm((x, tma_aligned_view(sfa_t, num_rows)), (w, w_scales), d, expert_ids)


def _fp8_masked(gemm, max_m, expected_m, d, x, sfa_t, w, w_scales, masked_m):
    gemm((x, tma_aligned_view(sfa_t, max_m)), (w, w_scales), d, masked_m, expected_m)


def _bf16_contiguous(gemm, d, x, w, expert_ids):
    gemm(x, w, d, expert_ids)


def _bf16_masked(gemm, expected_m, d, x, w, masked_m):
    gemm(x, w, d, masked_m, expected_m)


def _fp8_activations(x: jax.Array, x_scales: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """FP8 rows and their float32 scales; bfloat16 rows are quantized here (vLLM's recipe)."""
    if x.dtype == quant.FP8_DTYPE:
        return x, x_scales
    return quant.per_token_group_quant_fp8(x, BLOCK)


def _check_operands(x, w, x_scales, w_scales, *, grouped_rows: bool) -> None:
    """Shapes and dtypes DeepGEMM would otherwise reject inside the callback (at run time)."""
    if w.ndim != 3:
        raise ValueError(f"{w.shape=}: expected [E, N, K]")
    num_groups, n, k = w.shape
    lead = (num_groups,) if grouped_rows else ()
    if x.ndim != len(lead) + 2 or x.shape[: len(lead)] != lead or x.shape[-1] != k:
        want = "[E, max_m, K]" if grouped_rows else "[M, K]"
        raise ValueError(f"{x.shape=} and {w.shape=}: x must be {want}")
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"{w.shape=}: N and K must be multiples of {BLOCK} for DeepGEMM")
    if w.dtype == quant.FP8_DTYPE:
        want = quant.block_scale_shape(w.shape)
        if w_scales is None or w_scales.shape != want:
            got = None if w_scales is None else w_scales.shape
            raise ValueError(f"{w.dtype=} needs w_scales of shape {want}, got {got}")
        if x.dtype == quant.FP8_DTYPE:
            want_x = (*x.shape[:-1], k // BLOCK)
            if x_scales is None or x_scales.shape != want_x:
                got = None if x_scales is None else x_scales.shape
                raise ValueError(f"{x.dtype=} needs x_scales of shape {want_x}, got {got}")
        elif x.dtype != jnp.bfloat16:
            raise TypeError(f"{x.dtype=} with FP8 weights: expected float8_e4m3fn or bfloat16")
    elif w.dtype == jnp.bfloat16:
        if x.dtype != jnp.bfloat16:
            raise TypeError(f"{x.dtype=} with bfloat16 weights: expected bfloat16 activations")
    else:
        raise TypeError(f"{w.dtype=}: DeepGEMM takes float8_e4m3fn or bfloat16 weights")


grouped_gemm.GEMMS.register(DeepGemm())
