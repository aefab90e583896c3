"""The permute, wgrad and Mosaic FP8 GEMM wrappers on awkward inputs, against their pure-JAX
references: zero-size hidden, group, N and K dimensions (the references return empty or zero
arrays; nothing may index past an empty axis: the permute's front answers them itself, the
kernels launch nothing), and arguments that used to give NaN rows or an IndexError instead of
an error naming them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import grouped_gemm_backward, layouts
from moe_jax import permute as permute_front
from moe_jax.kernels import mosaic_fp8_gemm as mg
from moe_jax.kernels import wgrad as kernel_wgrad

IDS = jnp.array([[0, 1], [1, 1], [5, 0]])  # a duplicate in a row, an id past E


@pytest.mark.parametrize("is_scales_group_major", [False, True])
@pytest.mark.parametrize(
    ("hidden", "num_groups", "dtype"),
    [(0, None, jnp.bfloat16), (0, 0, jnp.float8_e4m3fn), (0, 2, jnp.float32), (128, 0, None)],
    ids=["H0", "H0_G0", "H0_G2", "G0"],
)
def test_permute_of_zero_columns_matches_the_reference(
    hidden, num_groups, dtype, is_scales_group_major
):
    """H = 0 or G = 0 with the Pallas copy named: its column (group) block used to read past the
    empty axis ("Slice size at index 1 in gather op is out of range") where the reference gives
    [M, 0]; the front now copies nothing along an empty axis."""
    x = jnp.ones((3, hidden), dtype or jnp.float8_e4m3fn)
    x_scales = None
    if num_groups is not None:
        x_scales = jnp.arange(3.0 * num_groups, dtype=jnp.float32).reshape(3, num_groups) + 1
    got = permute_front.permute(
        x,
        IDS,
        num_experts=2,
        x_scales=x_scales,
        alignment=4,
        is_scales_group_major=is_scales_group_major,
        impl="pallas_interpret",
    )
    want = layouts.permute_reference(x, IDS, num_experts=2, x_scales=x_scales, alignment=4)
    assert got.rows.shape == want.rows.shape and got.rows.dtype == want.rows.dtype
    np.testing.assert_array_equal(
        np.asarray(got.rows, np.float32), np.asarray(want.rows, np.float32)
    )
    for name in ("expert_ids", "inverse", "num_tokens_per_expert", "expert_ends"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    if x_scales is None:
        assert got.row_scales is None
    else:
        assert got.row_scales.shape == want.row_scales.shape
        np.testing.assert_array_equal(got.row_scales, want.row_scales)


@pytest.mark.parametrize(("n", "k"), [(0, 32), (16, 0)], ids=["N0", "K0"])
def test_wgrad_of_zero_columns_matches_the_reference(n, k):
    """N = 0 gives [E, 0, K] and K = 0 zeros (an empty sum), as the XLA wgrad; the kernel used
    to run a 128-wide tile over the empty axis (TypeError from its slice)."""
    dy = jnp.ones((32, n), jnp.float32)
    x = jnp.ones((32, k), jnp.float32)
    ids = jnp.asarray([0] * 16 + [2] * 16, jnp.int32)
    ends = jnp.array([16, 16, 32], jnp.int32)
    kwargs = dict(num_experts=3, alignment=16, out_dtype=jnp.float32)
    want = grouped_gemm_backward.grouped_wgrad(dy, x, ids, ends, impl="xla", **kwargs)
    got = kernel_wgrad.grouped_wgrad(dy, x, ids, ends, interpret=True, **kwargs)
    assert got.shape == want.shape == (3, n, k)
    np.testing.assert_array_equal(got, want)
    front = grouped_gemm_backward.grouped_wgrad(dy, x, ids, ends, impl="pallas_interpret", **kwargs)
    np.testing.assert_array_equal(front, want)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(alignment=0), ValueError, "alignment=0"),
        (dict(alignment=-16), ValueError, "alignment=-16"),
        (dict(dy=jnp.ones((32,))), ValueError, "dy.shape"),
    ],
    ids=["alignment0", "negative_alignment", "dy_1d"],
)
def test_wgrad_names_a_bad_argument(change, error, match):
    """alignment 0 passed the multiple-of-16 check and failed inside the kernel's slice;
    -16 ran; a 1-D dy failed to unpack its shape."""
    args = (
        dict(
            dy=jnp.ones((32, 16)),
            x=jnp.ones((32, 16)),
            expert_ids=None,
            expert_ends=jnp.array([16, 16, 32], jnp.int32),
            num_experts=3,
            alignment=16,
            out_dtype=jnp.float32,
            interpret=True,
        )
        | change
    )
    with pytest.raises(error, match=match):
        kernel_wgrad.grouped_wgrad(**args)


def _fp8_operands(*, m=64, n=256, k=128, num_experts=1):
    """Unit FP8 operands: rows 0-39 expert 0, the rest padding."""
    ids = jnp.asarray([0] * 40 + [-1] * (m - 40), jnp.int32)
    return dict(
        x=jnp.ones((m, k), jnp.float8_e4m3fn),
        w=jnp.ones((num_experts, n, k), jnp.float8_e4m3fn),
        expert_ids=ids,
        x_scales=jnp.ones((m, -(-k // 128)), jnp.float32),
        w_scales=jnp.ones((num_experts, -(-n // 128), -(-k // 128)), jnp.float32),
    )


def _mosaic_gemm(x, w, expert_ids, x_scales, w_scales, **kwargs):
    return mg.mosaic_fp8_gemm_contiguous(
        x,
        w,
        expert_ids,
        x_scales=x_scales,
        w_scales=w_scales,
        alignment=64,
        out_dtype=jnp.float32,
        interpret=True,
        **kwargs,
    )


def _mosaic_act_quant(
    x, w, expert_ids, x_scales, w_scales, fn=mg.mosaic_fp8_gemm_act_quant_contiguous
):
    options = mg.FusedGemm1Options(alignment=64, interpret=True)
    return fn(x, w, expert_ids, x_scales=x_scales, w1_scales=w_scales, options=options)


@pytest.mark.mosaic_interpret
@pytest.mark.parametrize(("n", "k"), [(0, 128), (256, 0)], ids=["N0", "K0"])
def test_mosaic_fp8_gemm_of_zero_columns(n, k):
    """N = 0 gives [M, 0] (the XLA and Pallas GEMMs' answer) and K = 0 zeros on the valid rows
    (the Pallas GEMM's); the kernel used to divide by zero column tiles or index an empty K."""
    y = _mosaic_gemm(**_fp8_operands(n=n, k=k))
    assert y.shape == (64, n) and y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y)[:40], 0.0)


@pytest.mark.mosaic_interpret
@pytest.mark.parametrize(("two_i", "k"), [(0, 128), (256, 0)], ids=["I0", "K0"])
def test_mosaic_fp8_act_quant_of_zero_columns(two_i, k):
    """I = 0 gives the reference's empty codes and scales; K = 0 the quantized act of GEMM1's
    zero output (the reference cannot dequantize K = 0 operands; the kernel used to raise
    ZeroDivisionError / IndexError)."""
    operands = _fp8_operands(n=two_i, k=k)
    q, scales = _mosaic_act_quant(**operands)
    inter = two_i // 2
    assert q.shape == (64, inter) and q.dtype == jnp.float8_e4m3fn
    assert scales.shape == (64, inter // 128) and scales.dtype == jnp.float32
    if k:
        want_q, want_scales = _mosaic_act_quant(
            **operands, fn=mg.mosaic_fp8_gemm_act_quant_reference
        )
    else:
        from moe_jax.act_quant import act_and_quant_reference

        want_q, want_scales = act_and_quant_reference(jnp.zeros((64, two_i), jnp.bfloat16))
    np.testing.assert_array_equal(
        np.asarray(q, np.float32)[:40], np.asarray(want_q, np.float32)[:40]
    )
    np.testing.assert_array_equal(np.asarray(scales)[:40], np.asarray(want_scales)[:40])


@pytest.mark.mosaic_interpret
@pytest.mark.parametrize("num_sms", [0, -1])
@pytest.mark.parametrize("gated", [False, True], ids=["gemm", "act_quant"])
def test_mosaic_fp8_refuses_a_bad_num_sms(num_sms, gated):
    """num_sms=0 launched no program and returned the output buffer unwritten (NaN rows in
    interpret mode) instead of naming the argument."""
    operands = _fp8_operands()
    with pytest.raises(ValueError, match="num_sms"):
        if gated:
            mg.mosaic_fp8_gemm_act_quant_contiguous(
                operands["x"],
                operands["w"],
                operands["expert_ids"],
                x_scales=operands["x_scales"],
                w1_scales=operands["w_scales"],
                options=mg.FusedGemm1Options(alignment=64, num_sms=num_sms, interpret=True),
            )
        else:
            _mosaic_gemm(**operands, num_sms=num_sms)


@pytest.mark.parametrize("gated", [False, True], ids=["gemm", "act_quant"])
def test_mosaic_fp8_names_a_one_dimensional_x(gated):
    """Without a config the heuristic read x.shape[1] before any check: IndexError."""
    operands = _fp8_operands() | dict(x=jnp.ones((64,), jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="x.shape"):
        (_mosaic_act_quant if gated else _mosaic_gemm)(**operands)
