"""`moe_jax.kernels._wide_offsets`: 1-byte arrays of > 2**31 elements get int64 pointer offsets.

On the CPU probe kernels are lowered for CUDA without running (`lower_for_hopper`), with Pallas'
`debug=True` printing the Triton IR, and the element offsets of their FP8 load or store are read
from that IR: i64 with the patch, i32 without it (JAX's bug, which the second test
documents: when it fails, JAX counts elements and the patch module can go). On the GPU a
grouped GEMM over FP8 weights of 2.3e9 elements reads an expert past element 2**31 and must see
that expert's values, not another's.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hopper_lowering import lower_for_hopper
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from moe_jax import quant
from moe_jax.kernels import _triton, _wide_offsets

ROWS, COLS = 16, 128
DEEPSEEK_W2 = (256, 7168, 2048)  # 3.76e9 FP8 elements: past 2**31, below 2**32 bytes
TILE = jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32)


def _load_probe(big_ref, out_ref):
    out_ref[...] = big_ref[pl.program_id(0), pl.ds(0, ROWS), pl.ds(0, COLS)].astype(jnp.float32)


def _store_probe(tile_ref, big_ref):
    big_ref[pl.program_id(0), pl.ds(0, ROWS), pl.ds(0, COLS)] = tile_ref[...].astype(big_ref.dtype)


def _offset_types(shape, dtype, capsys, *, store: bool = False) -> list[str]:
    """Element types of the offsets added to the pointer of the probe's large operand (its
    input, or with `store` its output), read from the Triton IR that `debug=True` prints."""
    big = jax.ShapeDtypeStruct(shape, dtype)

    def run(operand):
        return pl.pallas_call(
            _store_probe if store else _load_probe,
            grid=(2,),
            out_shape=big if store else TILE,
            # JAX's own parameters: `_triton.compiler_params` would install the patch again
            compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
            debug=True,
        )(operand)

    capsys.readouterr()
    lower_for_hopper(run, TILE if store else big)
    ir = capsys.readouterr().out
    # The small operand is float32, so the large one's pointers are the only other ones.
    tile = f"{ROWS}x{COLS}"
    pattern = rf"tt\.addptr .*tensor<{tile}x!tt\.ptr<(?!f32)\w+>>, tensor<{tile}x(i\d+)>"
    found = re.findall(pattern, ir)
    assert found, f"no addptr on the {dtype} operand in the probe's Triton IR:\n{ir[:2000]}"
    return found


@pytest.mark.parametrize(
    "shape, dtype, want",
    [
        (DEEPSEEK_W2, quant.FP8_DTYPE, "i64"),
        ((160, 7168, 2048), jnp.uint8, "i64"),  # 2.35e9 elements
        ((128, 7168, 2048), quant.FP8_DTYPE, "i32"),  # 1.88e9 elements: int32 holds them
        ((128, 7168, 2048), jnp.bfloat16, "i32"),  # 3.76e9 bytes, 1.88e9 elements
        ((256, 7168, 2048), jnp.bfloat16, "i64"),  # past 2**32 bytes: JAX's own int64 case
    ],
)
@pytest.mark.parametrize("store", [False, True], ids=["load", "store"])
def test_patched_lowering_widens_only_large_byte_arrays(shape, dtype, want, store, capsys):
    assert _triton.wide_byte_offsets(), "the patch did not install on this JAX"
    assert set(_offset_types(shape, dtype, capsys, store=store)) == {want}


@pytest.mark.skipif(not _triton.wide_byte_offsets(), reason="the patch did not install")
def test_unpatched_lowering_still_wraps(monkeypatch, capsys):
    """JAX's own lowering picks int32 for the DeepSeek-V3 w2: the bug the patch exists for.

    When this fails, JAX's threshold counts elements: delete `kernels/_wide_offsets.py`, its
    call in `_triton.py` and the grouped GEMM's uint16 fallback.
    """
    from jax._src.pallas.triton import lowering

    patched = lowering._compute_offsets_from_indices
    monkeypatch.setattr(lowering, "_compute_offsets_from_indices", patched.__wrapped__)
    assert set(_offset_types(DEEPSEEK_W2, quant.FP8_DTYPE, capsys)) == {"i32"}


def test_install_is_idempotent():
    from jax._src.pallas.triton import lowering

    before = lowering._compute_offsets_from_indices
    assert _wide_offsets.install() and lowering._compute_offsets_from_indices is before


@pytest.mark.parametrize(
    "shape, dtype, want",
    [
        ((2**31 + 1,), jnp.uint8, True),
        ((2**31,), quant.FP8_DTYPE, False),  # last offset 2**31 - 1 fits in int32
        ((2**31,), jnp.bfloat16, False),
        ((0,), jnp.int8, False),
    ],
)
def test_needs_wide_offsets(shape, dtype, want):
    assert _wide_offsets.needs_wide_offsets(shape, dtype) is want


@pytest.mark.gpu
def test_grouped_gemm_reads_an_expert_past_int32_offsets():
    """FP8 w [160, 7168, 2048] (2.35e9 elements); rows of experts 159 and 3 against their
    constant weights: with int32 offsets expert 159's load wraps onto other memory."""
    from moe_jax.kernels.grouped_gemm import grouped_gemm_contiguous

    assert _triton.wide_byte_offsets(), "the patch did not install: the uint16 fallback would run"
    num_experts, n, k = 160, 7168, 2048

    @jax.jit
    def make_weights():
        # w[e] = 0.25 * (1 + e % 7): distinct per neighbouring expert, exact in e4m3.
        per_expert = 0.25 * (1 + jnp.arange(num_experts) % 7)
        return jnp.broadcast_to(
            per_expert.astype(quant.FP8_DTYPE)[:, None, None], (num_experts, n, k)
        )

    w = make_weights()
    w_scales = jnp.ones((num_experts, n // 128, k // 128), jnp.float32)
    experts = np.array([159] * 16 + [3] * 16, np.int32)
    x = jnp.ones((experts.size, k), quant.FP8_DTYPE)
    x_scales = jnp.ones((experts.size, k // 128), jnp.float32)
    y = grouped_gemm_contiguous(
        x,
        w,
        jnp.asarray(experts),
        x_scales=x_scales,
        w_scales=w_scales,
        alignment=16,
        out_dtype=jnp.float32,
    )
    want = k * 0.25 * (1 + experts % 7)
    np.testing.assert_allclose(np.asarray(y), np.broadcast_to(want[:, None], y.shape), rtol=1e-6)
