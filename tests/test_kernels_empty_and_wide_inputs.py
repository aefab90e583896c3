"""The ops and Pallas kernels on awkward inputs, against their pure-JAX references: empty column,
weight and expert dimensions (the references return empty or zero arrays; the fronts answer them
without launching a kernel, the GEMM kernels launch nothing), and expert ids wider than int32
(outside [0, E): no expert, not a wrapped one)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gemm_problems import grouped_gemm_contiguous_reference

from moe_jax import act_quant as act_quant_front
from moe_jax import grouped_gemm, layouts
from moe_jax.kernels import grouped_gemm as gg
from moe_jax.kernels import routing_metadata as kernel_rm


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_quantization_of_zero_columns_gives_empty_arrays(impl):
    """H = 0 (and I = 0): zero groups per row, as the reference returns, not a slice error."""
    x = jnp.zeros((3, 0), jnp.bfloat16)
    for q, scales in (
        act_quant_front.group_quant(x, impl=impl),
        act_quant_front.act_and_quant(x, impl=impl),
    ):
        assert q.shape == (3, 0) and q.dtype == jnp.float8_e4m3fn
        assert scales.shape == (3, 0) and scales.dtype == jnp.float32
    q, scales = act_quant_front.act_and_quant(x, impl=impl, expert_ids=jnp.zeros(3, jnp.int32))
    assert q.shape == scales.shape == (3, 0)
    q, scales = act_quant_front.act_and_quant(jnp.zeros((0, 256), jnp.float32), impl=impl)
    assert q.shape == (0, 128) and scales.shape == (0, 1)


@pytest.mark.parametrize(
    ("num_experts", "n", "k"), [(2, 0, 32), (2, 16, 0), (0, 16, 32)], ids=["N0", "K0", "E0"]
)
def test_grouped_gemm_of_empty_dimensions(num_experts, n, k):
    """N = 0 gives [M, 0]; K = 0 gives zeros (an empty sum); E = 0 leaves every row padding."""
    ids = jnp.asarray([0] * 3 + [-1] * 13 if num_experts else [-1] * 16, jnp.int32)
    x = jnp.ones((16, k), jnp.bfloat16)
    w = jnp.ones((num_experts, n, k), jnp.bfloat16)
    y = gg.grouped_gemm_contiguous(x, w, ids, alignment=16, out_dtype=jnp.float32, interpret=True)
    assert y.shape == (16, n) and y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y)[np.asarray(ids) >= 0], 0.0)


@pytest.mark.parametrize(("num_experts", "max_m"), [(2, 0), (0, 4)], ids=["max_m0", "E0"])
def test_masked_gemm_of_empty_dimensions(num_experts, max_m):
    """An empty masked layout gives the empty [E, max_m, N] output, as the XLA backend does."""
    x = jnp.ones((num_experts, max_m, 32), jnp.bfloat16)
    w = jnp.ones((num_experts, 16, 32), jnp.bfloat16)
    counts = jnp.zeros((num_experts,), jnp.int32)
    for name in ("xla", "pallas_interpret"):
        y = grouped_gemm.GEMMS.get(name).masked(x, w, counts, out_dtype=jnp.float32)
        assert y.shape == (num_experts, max_m, 16) and y.dtype == jnp.float32, name


def test_routing_metadata_sends_wide_out_of_range_ids_nowhere():
    """Under x64 an int64 id of 2**32 + 1 is outside [0, E): nowhere, as in the reference, not
    expert 1 after a wrapping cast to int32."""
    with jax.enable_x64(True):
        ids = jnp.asarray([[2**32 + 1, 0], [1, -(2**32) + 1]], jnp.int64)
        kwargs = dict(num_experts=2, alignment=4, num_rows=12)
        got = kernel_rm.routing_metadata(ids, **kwargs, interpret=True)
        want = layouts.routing_metadata(ids, **kwargs)
        for name in ("inverse", "num_tokens_per_expert", "expert_ends", "source", "expert_ids"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        assert got.inverse.tolist() == [[-1, 0], [4, -1]]


def test_routing_metadata_takes_narrow_id_dtypes_past_their_range():
    """int8 ids with E = 300 experts: every id the dtype holds is a valid expert, in the kernel
    and in its reference (which compared int8 ids with 300 and raised OverflowError)."""
    ids = jnp.asarray([[50, 100], [-1, 7]], jnp.int8)
    kwargs = dict(num_experts=300, alignment=1, num_rows=4)
    got = kernel_rm.routing_metadata(ids, **kwargs, interpret=True)
    want = layouts.routing_metadata(ids, **kwargs)
    assert got.inverse.tolist() == want.inverse.tolist() == [[1, 2], [-1, 0]]
    assert got.expert_ids.tolist() == want.expert_ids.tolist() == [7, 50, 100, -1]


def test_grouped_gemm_treats_wide_out_of_range_ids_as_padding():
    """Under x64 an int64 row id of 2**32 + 1 is padding (no expert) in the Pallas GEMM's
    reference, not expert 1 after a wrapping cast; the kernel agrees on the valid rows."""
    with jax.enable_x64(True):
        ids = jnp.asarray([1] * 3 + [2**32 + 1] + [-1] * 12, jnp.int64)
        x = jnp.ones((16, 32), jnp.bfloat16)
        w = jnp.ones((2, 16, 32), jnp.bfloat16)
        kwargs = dict(alignment=16, out_dtype=jnp.float32)
        want = grouped_gemm_contiguous_reference(x, w, ids, **kwargs)
        got = gg.grouped_gemm_contiguous(x, w, ids, **kwargs, interpret=True)
        assert np.asarray(want)[3].tolist() == [0.0] * 16
        np.testing.assert_array_equal(np.asarray(got)[:3], np.asarray(want)[:3])
