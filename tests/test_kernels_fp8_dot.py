"""`moe_jax.kernels._fp8_dot`: the FP8 dots of a registered Pallas kernel lower with Triton's
`maxNumImpreciseAcc` (so Triton may run them on Hopper's FP8 wgmma); everything else lowers as
before. Checked on the CPU by lowering for CUDA and reading the Triton IR that Pallas prints
with `debug=True`. The numerics of the wgmma path run on the GPU (`test_kernels_grouped_gemm.py`'s
configs)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from hopper_lowering import lower_for_hopper
from jax.experimental import pallas as pl

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


def _dot_attributes(fn, args, capsys, monkeypatch) -> list[str]:
    """The `tt.dot` lines of the Triton IR of `fn`'s one `pallas_call`, lowered for sm_90 with
    Pallas' `debug=True` forced on."""
    original = pl.pallas_call
    monkeypatch.setattr(pl, "pallas_call", lambda *a, **kw: original(*a, **{**kw, "debug": True}))
    capsys.readouterr()
    lower_for_hopper(fn, *args)
    monkeypatch.setattr(pl, "pallas_call", original)
    return [line for line in capsys.readouterr().out.splitlines() if "tt.dot " in line]


BASE = gg.GroupedGemmConfig(block_m=32, block_n=128, is_transposed=True, is_fp8_dot=True)


def test_registered_kernel_dots_get_the_attribute_and_others_do_not(capsys, monkeypatch):
    wgmma = dataclasses.replace(BASE, block_m=16, is_fp8_wgmma=True)
    [dot] = _dot_attributes(*_gemm(wgmma), capsys, monkeypatch)
    assert re.search(r"maxNumImpreciseAcc = 128 : i32", dot)
    # The same kernel without the option, lowered after the registration: unchanged.
    [plain] = _dot_attributes(*_gemm(BASE), capsys, monkeypatch)
    assert "maxNumImpreciseAcc" not in plain


def test_an_unregistered_pallas_fp8_dot_is_untouched(capsys, monkeypatch):
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
    [dot] = _dot_attributes(fn, (spec, spec), capsys, monkeypatch)
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
