"""The permute (`moe_jax.permute.permute`: route, then the row copy of each `PERMUTES`
implementation, the Pallas one `moe_jax.kernels.permute.gather_rows`) vs the NumPy loop in
`oracles.permute` and, bit for bit, the reference. A copy has no arithmetic, so interpret mode
covers the compiled kernel's results; only its Triton indexing and masking run on the GPU alone
(`-m gpu`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest
from contract import impl_params, runs_or_skip

from moe_jax import layouts
from moe_jax import permute as permute_front
from moe_jax.kernels.permute import PermuteConfig
from moe_jax.quant import per_token_group_quant_fp8

# "xla" through the front: the reference's own oracle test is tests/test_layouts.py's.
IMPLS = impl_params(permute_front.PERMUTES)  # every name, interpret twins too
FIELDS = ("rows", "row_scales", "expert_ids", "inverse", "num_tokens_per_expert", "expert_ends")


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    num_tokens: int
    topk: int
    num_experts: int
    hidden: int
    alignment: int = 128
    id_low: int = -2  # ids drawn from [id_low, num_experts + id_high)
    id_high: int = 2
    num_global: int | None = None  # with an expert_map of this many global experts
    only_experts: tuple[int, ...] | None = None  # route only to these (the rest stay empty)
    dtype: jnp.dtype = jnp.bfloat16

    def __str__(self):
        return self.name


CI_PROBLEMS = [
    Problem("dups_and_out_of_range", 7, 3, 5, 192, alignment=4),
    Problem("one_token", 1, 1, 1, 64, id_low=0, id_high=0),
    Problem("no_tokens", 0, 4, 3, 64),
    Problem("odd_tokens_h320_f32", 13, 4, 6, 320, alignment=16, dtype=jnp.float32),
    Problem("alignment_1_f32", 9, 2, 4, 128, alignment=1, dtype=jnp.float32),
    Problem("expert_map_holes", 9, 4, 4, 128, alignment=8, num_global=10),
    Problem("empty_experts", 6, 3, 16, 64, alignment=8, only_experts=(0, 3, 15)),
    Problem("all_invalid", 4, 2, 3, 64, alignment=4, id_low=-3, id_high=-4),
]


def _routing(problem: Problem, rng: np.random.Generator):
    shape = (problem.num_tokens, problem.topk)
    expert_map = None
    if problem.only_experts is not None:
        ids = rng.choice(np.array(problem.only_experts), size=shape)
    elif problem.num_global is not None:
        ids = rng.integers(-2, problem.num_global + 2, size=shape)
        local = rng.permutation(problem.num_global)
        expert_map = np.where(local < problem.num_experts, local, -1)  # holes: -1
    else:
        ids = rng.integers(problem.id_low, problem.num_experts + problem.id_high, size=shape)
    ids = jnp.asarray(ids, jnp.int32)
    return ids, None if expert_map is None else jnp.asarray(expert_map, jnp.int32)


_reference = jax.jit(layouts.permute_reference, static_argnames=("num_experts", "alignment"))


def _oracle(x, ids, *, num_experts, expert_map, alignment, x_scales=None):
    return oracles.permute(
        np.asarray(x),
        np.asarray(ids),
        num_experts,
        alignment=alignment,
        expert_map=None if expert_map is None else np.asarray(expert_map),
        x_scales=None if x_scales is None else np.asarray(x_scales),
    )


def _run(impl, x, ids, **kwargs):
    runs_or_skip(permute_front.PERMUTES.get(impl), permute_front.problem_for(x))
    return permute_front.permute(x, ids, impl=impl, **kwargs)


def _assert_bitwise(a: layouts.ContiguousLayout, b: layouts.ContiguousLayout):
    for field in FIELDS:
        u, v = getattr(a, field), getattr(b, field)
        if u is None or v is None:
            assert u is None and v is None, field
            continue
        u, v = np.asarray(u), np.asarray(v)
        assert u.shape == v.shape and u.dtype == v.dtype, (field, u.shape, v.shape)
        np.testing.assert_array_equal(u.view(np.uint8), v.view(np.uint8), err_msg=field)


def _assert_matches_oracle(lay, oracle, *, is_padding_zeroed: bool = True):
    """Every row (and scale) as the oracle's; without `is_padding_zeroed`, real rows only."""
    # A copy is exact in every dtype, so the oracle comparison has zero tolerance.
    for field in ("expert_ids", "inverse", "num_tokens_per_expert", "expert_ends"):
        np.testing.assert_array_equal(np.asarray(getattr(lay, field)), oracle[field], field)
    assert lay.inverse.dtype == jnp.int32 and lay.expert_ids.dtype == jnp.int32
    checked = (np.asarray(lay.expert_ids) >= 0) | is_padding_zeroed  # padding: zeros
    rows = np.asarray(lay.rows.astype(jnp.float32))
    np.testing.assert_array_equal(rows[checked], oracle["rows"].astype(np.float32)[checked])
    if oracle["row_scales"] is not None:
        scales = np.asarray(lay.row_scales)
        np.testing.assert_array_equal(scales[checked], oracle["row_scales"][checked])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("problem", CI_PROBLEMS, ids=str)
def test_permute_matches_oracle(impl, problem):
    rng = np.random.default_rng(oracles.seed("permute", str(problem)))
    ids, expert_map = _routing(problem, rng)
    x = jnp.asarray(rng.standard_normal((problem.num_tokens, problem.hidden)), problem.dtype)
    kwargs = dict(
        num_experts=problem.num_experts, expert_map=expert_map, alignment=problem.alignment
    )
    lay = _run(impl, x, ids, **kwargs)
    _assert_matches_oracle(lay, _oracle(x, ids, **kwargs))
    _assert_bitwise(lay, _reference(x, ids, **kwargs))


FP8_PROBLEMS = [
    Problem("fp8_dups_out_of_range", 11, 4, 6, 256, alignment=8),
    Problem("fp8_expert_map", 5, 3, 3, 384, alignment=4, num_global=7),
]


def _fp8_problem(name: str, problem: Problem):
    """(FP8 tokens, their float32 scales, topk_ids, the permute's keyword arguments), seeded."""
    rng = np.random.default_rng(oracles.seed(name, str(problem)))
    ids, expert_map = _routing(problem, rng)
    x = jnp.asarray(rng.standard_normal((problem.num_tokens, problem.hidden)) * 3, jnp.float32)
    q, scales = per_token_group_quant_fp8(x)
    kwargs = dict(
        num_experts=problem.num_experts, expert_map=expert_map, alignment=problem.alignment
    )
    return q, scales, ids, kwargs


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("is_scales_group_major", [False, True], ids=["scales_rows", "scales_gm"])
@pytest.mark.parametrize("problem", FP8_PROBLEMS, ids=str)
def test_permute_fp8_rows_carry_scales(impl, is_scales_group_major, problem):
    """Either layout of the scales in the kernel's memory gives the same values."""
    q, scales, ids, kwargs = _fp8_problem("permute_fp8", problem)
    lay = _run(impl, q, ids, x_scales=scales, is_scales_group_major=is_scales_group_major, **kwargs)
    assert lay.rows.dtype == jnp.float8_e4m3fn and lay.row_scales.dtype == jnp.float32
    _assert_matches_oracle(lay, _oracle(q, ids, x_scales=scales, **kwargs))
    _assert_bitwise(lay, _reference(q, ids, x_scales=scales, **kwargs))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("problem", FP8_PROBLEMS, ids=str)
def test_permute_fp8_unzeroed_padding_keeps_every_real_row(impl, problem):
    """`is_padding_zeroed=False` (the FP8 inference path): padding rows and their scales are
    unspecified, every real row, scale and index is still the oracle's, bit for bit."""
    q, scales, ids, kwargs = _fp8_problem("permute_fp8_unzeroed", problem)
    lay = _run(impl, q, ids, x_scales=scales, is_padding_zeroed=False, **kwargs)
    is_pad = np.asarray(lay.expert_ids) < 0
    assert is_pad.any(), "the problem should have padding rows"
    _assert_matches_oracle(lay, _oracle(q, ids, x_scales=scales, **kwargs), is_padding_zeroed=False)


def test_permute_front_refuses_unzeroed_padding_for_float_rows():
    x = jnp.ones((4, 64), jnp.bfloat16)
    ids = jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(ValueError, match="is_padding_zeroed=False with bfloat16 rows"):
        permute_front.permute(x, ids, num_experts=2, alignment=4, is_padding_zeroed=False)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (dict(x=jnp.zeros((4, 8), jnp.int32)), TypeError, "x.dtype"),
        (dict(topk_ids=jnp.zeros((3, 2), jnp.int32)), ValueError, "topk_ids.shape"),
        (dict(topk_ids=jnp.zeros((4, 2), jnp.float32)), TypeError, "topk_ids.dtype"),
        (dict(num_experts=0), ValueError, "num_experts"),
        (dict(x_scales=jnp.zeros((3, 1), jnp.float32)), ValueError, "x_scales.shape"),
        (dict(x_scales=jnp.zeros((4, 1), jnp.bfloat16)), TypeError, "x_scales.dtype"),
        (dict(expert_map=jnp.zeros((2, 2), jnp.int32)), TypeError, "expert_map"),
        (dict(alignment=0), ValueError, "alignment"),
    ],
)
@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_permute_rejects_bad_inputs(impl, args, error, match):
    """The front checks once, whichever implementation copies."""
    kwargs = dict(x=jnp.zeros((4, 8)), topk_ids=jnp.zeros((4, 2), jnp.int32), num_experts=2)
    kwargs.update(args)
    x, ids = kwargs.pop("x"), kwargs.pop("topk_ids")
    with pytest.raises(error, match=match):
        permute_front.permute(x, ids, impl=impl, **kwargs)


def test_permute_config_rejects_bad_blocks():
    with pytest.raises(ValueError, match="block_m"):
        PermuteConfig(block_m=3)


def test_an_implementation_object_differentiates_with_its_namesake_unpermute():
    """`impl` may be an implementation object; its backward used to call that same object (a
    permute) as the unpermute."""
    ids = jnp.array([[0, 1], [1, 1]], jnp.int32)
    for name in ("xla", "pallas_interpret"):
        impl = permute_front.PERMUTES.get(name)
        grad = jax.grad(
            lambda x, impl=impl: permute_front.permute(
                x, ids, num_experts=2, alignment=1, impl=impl
            ).rows.sum()
        )(jnp.ones((2, 64)))
        np.testing.assert_array_equal(grad, np.full((2, 64), 2.0))


def test_scales_given_with_float_rows_get_their_gradient():
    """x_scales travel with the rows; with float rows the permute is differentiated, and the
    scales' cotangent is summed back per token like the rows' (it used to be dropped: zeros)."""
    ids = jnp.array([[0, 1], [1, -1], [2, 2]], jnp.int32)
    num_rows = layouts.contiguous_num_rows(3, 2, 3, 2)
    weights = jnp.arange(1.0, 1.0 + num_rows * 2).reshape(num_rows, 2)

    def loss(scales):
        lay = permute_front.permute(
            jnp.ones((3, 256)), ids, num_experts=3, alignment=2, x_scales=scales
        )
        return jnp.sum(lay.row_scales * weights)

    scales = jnp.full((3, 2), 2.0)
    got = jax.grad(loss)(scales)
    lay = permute_front.permute(jnp.ones((3, 256)), ids, num_experts=3, alignment=2)
    inverse = np.asarray(lay.inverse)
    want = np.zeros((3, 2))
    for t, j in np.ndindex(inverse.shape):
        if inverse[t, j] >= 0:
            want[t] += np.asarray(weights)[inverse[t, j]]
    np.testing.assert_array_equal(got, want)
