"""`moe_jax.kernels._fp8_dot`: the FP8 dots of a registered Pallas kernel lower with Triton's
`maxNumImpreciseAcc` (so Triton may run them on Hopper's FP8 wgmma); everything else lowers as
before. Checked on the CPU by lowering for CUDA and reading the Triton IR; with the `triton`
package installed (not in CI), also by compiling for sm_90 and counting the matrix instructions.
The numerics of the wgmma path run on the GPU (`test_kernels_grouped_gemm.py`'s configs)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from moe_jax.cli import kernel_sass
from moe_jax.kernels import _fp8_dot, _triton
from moe_jax.kernels import grouped_gemm as gg

ROWS, EXPERTS, N, K = 64, 4, 128, 256


def _gemm(config: gg.GroupedGemmConfig, dtype=jnp.float8_e4m3fn):
    def fn(x, w, ids, xs, ws):
        return gg.grouped_gemm_contiguous(
            x, w, ids, x_scales=xs, w_scales=ws, alignment=32, config=config
        )

    spec = jax.ShapeDtypeStruct
    return fn, (
        spec((ROWS, K), dtype),
        spec((EXPERTS, N, K), dtype),
        spec((ROWS,), jnp.int32),
        spec((ROWS, K // 128), jnp.float32),
        spec((EXPERTS, N // 128, K // 128), jnp.float32),
    )


def _dot_attributes(fn, args) -> list[str]:
    [module] = kernel_sass.triton_modules(fn, args)
    return [line for line in module.ir.splitlines() if "tt.dot " in line]


BASE = gg.GroupedGemmConfig(block_m=32, block_n=128, is_transposed=True, is_fp8_dot=True)


def test_registered_kernel_dots_get_the_attribute_and_others_do_not():
    wgmma = dataclasses.replace(BASE, block_m=16, is_fp8_wgmma=True)
    [dot] = _dot_attributes(*_gemm(wgmma))
    assert re.search(r"maxNumImpreciseAcc = 128 : i32", dot)
    # The same kernel without the option, lowered after the registration: unchanged.
    [plain] = _dot_attributes(*_gemm(BASE))
    assert "maxNumImpreciseAcc" not in plain


def test_an_unregistered_pallas_fp8_dot_is_untouched():
    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = jax.lax.dot_general(
            a_ref[...], b_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )

    def fn(a, b):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((64, 64), jnp.float32),
            name="unregistered_fp8_dot",
            compiler_params=_triton.compiler_params(num_warps=4, num_stages=1),
        )(a, b)

    spec = jax.ShapeDtypeStruct((64, 128), jnp.float8_e4m3fn)
    assert _fp8_dot.install()
    [dot] = _dot_attributes(fn, (spec, spec))
    assert "maxNumImpreciseAcc" not in dot


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="max_k=0"):
        _fp8_dot.allow_imprecise_accumulation("kernel", 0)
    with pytest.raises(ValueError, match="is_fp8_wgmma=True needs is_fp8_dot=True"):
        gg.GroupedGemmConfig(is_fp8_wgmma=True)
    bf16 = dataclasses.replace(BASE, is_fp8_wgmma=True)
    x = jnp.zeros((ROWS, K), jnp.bfloat16)
    w = jnp.zeros((EXPERTS, N, K), jnp.bfloat16)
    with pytest.raises(ValueError, match="is_fp8_wgmma=True but the operands are not FP8"):
        gg.grouped_gemm_contiguous(
            x, w, jnp.zeros(ROWS, jnp.int32), alignment=32, config=bf16, interpret=True
        )


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_attribute_turns_mma_sync_into_fp8_wgmma(tmp_path):
    plain, wgmma = (
        kernel_sass.compile_sass(module, str(tmp_path), top=64)
        for config in (BASE, dataclasses.replace(BASE, is_fp8_wgmma=True))
        for module in kernel_sass.triton_modules(*_gemm(config))
    )
    assert dict(plain.opcodes).get("HMMA", 0) > 0 and "QGMMA" not in dict(plain.opcodes)
    assert dict(wgmma.opcodes).get("QGMMA", 0) > 0 and "HMMA" not in dict(wgmma.opcodes)
