"""Boundary checks of the training fronts: `grouped_gemm_backward.grouped_wgrad` and
`fp8_training.grouped_gemm_contiguous` / `quantize_blocks` refuse bad operands, naming them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from moe_jax import fp8_training, grouped_gemm, grouped_gemm_backward

M, N, K, ALIGN = 16, 4, 3, 8


def _wgrad(dy, x, expert_ids, *, alignment=ALIGN, front=grouped_gemm_backward.grouped_wgrad):
    return front(
        dy,
        x,
        expert_ids,
        jnp.array([M], jnp.int32),
        num_experts=1,
        alignment=alignment,
        out_dtype=jnp.float32,
        impl="xla",
    )


FRONTS = [
    pytest.param(grouped_gemm_backward.grouped_wgrad, id="grouped_wgrad"),
    pytest.param(grouped_gemm_backward.grouped_wgrad_zero_padded, id="zero_padded"),
]


@pytest.mark.parametrize("front", FRONTS)
def test_wgrad_refuses_x_with_other_rows_than_dy(front):
    # a one-row x used to broadcast over all M rows: dw = sum_r dy[r]^T x[0], silently
    with pytest.raises(ValueError, match=r"dy\.shape=\(16, 4\) x\.shape=\(1, 3\)"):
        _wgrad(jnp.ones((M, N)), jnp.ones((1, K)), jnp.zeros((M,), jnp.int32), front=front)


@pytest.mark.parametrize("front", FRONTS)
def test_wgrad_refuses_expert_ids_of_other_length(front):
    with pytest.raises(ValueError, match=r"expert_ids\.shape=\(1,\)"):
        _wgrad(jnp.ones((M, N)), jnp.ones((M, K)), jnp.zeros((1,), jnp.int32), front=front)


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("alignment", [0, 6])
def test_wgrad_refuses_alignment_that_does_not_divide_the_rows(front, alignment):
    # was a ZeroDivisionError (0) or a reshape TypeError (6) that named no argument
    with pytest.raises(ValueError, match=rf"alignment={alignment}"):
        _wgrad(
            jnp.ones((M, N)),
            jnp.ones((M, K)),
            jnp.zeros((M,), jnp.int32),
            alignment=alignment,
            front=front,
        )


def _fp8_gemm(x, w):
    ids = jnp.zeros((x.shape[0],), jnp.int32)
    return fp8_training.grouped_gemm_contiguous(
        grouped_gemm.GEMMS.get("xla"),
        x,
        w,
        ids,
        jnp.array([x.shape[0]], jnp.int32),
        recipe=fp8_training.Fp8Training(quant_impl="xla"),
        alignment=16,
        out_dtype=jnp.float32,
    )


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_recipe_gemm_refuses_fp8_weights(dtype):
    # FP8 weights used to run (their scales ignored) and get an FP8 gradient, although
    # gradients through FP8 weights are documented as undefined
    w = jnp.full((1, 128, 128), 0.5, dtype)
    x = jnp.ones((16, 128))
    with pytest.raises(TypeError, match=rf"w\.dtype={jnp.dtype(dtype).name}"):
        jax.grad(lambda w: _fp8_gemm(x, w).sum())(w)


@pytest.mark.parametrize("shape", [(1, 200, 128), (1, 128, 64), (128, 128)])
def test_quantize_blocks_refuses_shapes_off_the_128_grid(shape):
    # were a reshape TypeError or an unpacking ValueError that named no argument
    with pytest.raises(ValueError, match=r"w\.shape=.*multiples of 128"):
        fp8_training.quantize_blocks(jnp.ones(shape))


def test_fp8_recipe_gemm_refuses_n_off_the_128_grid():
    with pytest.raises(ValueError, match=r"w\.shape=\(1, 200, 128\)"):
        _fp8_gemm(jnp.ones((16, 128)), jnp.ones((1, 200, 128)))
