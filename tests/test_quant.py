"""FP8 block quantization (`moe_jax.quant`) bit for bit against the NumPy + ml_dtypes oracle."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import oracles
import pytest

from moe_jax import quant

pytestmark = pytest.mark.cpu_numerics  # XLA:CPU rounding (conftest.py)

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Round trip |dequant(quant(x)) - x| <= half an e4m3 ulp at the group's scale: 2^-4 * amax.
ROUND_TRIP_RTOL = 2.0**-4


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8 if np.asarray(a).dtype.itemsize == 1 else np.uint32)


@dataclasses.dataclass(frozen=True)
class GroupProblem:
    name: str
    shape: tuple[int, ...]
    group_size: int = 128

    def __str__(self):
        return self.name


GROUP_PROBLEMS = [
    GroupProblem("T1_H128", (1, 128)),
    GroupProblem("T7_H384", (7, 384)),
    GroupProblem("T0_H256", (0, 256)),
    GroupProblem("E3_T5_H256", (3, 5, 256)),
    GroupProblem("T4_H96_g32", (4, 96), group_size=32),
]


def _activations(shape, dtype, rng):
    """Normal values over several magnitudes, an all-zero group and a few huge/tiny entries."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-12, 8, shape[:-1] + (1,)))
    if x.size:
        flat = x.reshape(-1, shape[-1])
        flat[0, :] = 0.0  # amax = 0: the 1e-10 floor keeps the scale finite, q = 0
        flat[-1, -1] = 1e4
    return x.astype(DTYPES[dtype])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("problem", GROUP_PROBLEMS, ids=str)
def test_per_token_group_quant_fp8_is_bitwise_the_oracle(problem, dtype, jit):
    rng = np.random.default_rng(oracles.seed("group", str(problem), dtype, jit))
    x = _activations(problem.shape, dtype, rng)
    fn = lambda a: quant.per_token_group_quant_fp8(a, problem.group_size)
    q, s = (jax.jit(fn) if jit else fn)(jnp.asarray(x))
    ref_q, ref_s = oracles.per_token_group_quant_fp8(x, problem.group_size)
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
    assert q.shape == x.shape and s.shape == (*x.shape[:-1], x.shape[-1] // problem.group_size)
    np.testing.assert_array_equal(_bits(q), _bits(ref_q))
    np.testing.assert_array_equal(_bits(s), _bits(ref_s))


def test_per_token_group_quant_fp8_scale_recipe():
    """s = max(amax, 1e-10) / 448, and the group's amax lands exactly on +-448."""
    x = jnp.zeros((2, 256)).at[0, 3].set(-8.0).at[0, 200].set(1.0)
    q, s = quant.per_token_group_quant_fp8(x)
    assert s.tolist() == [
        [np.float32(8.0) / np.float32(448.0), np.float32(1.0) / np.float32(448.0)],
        [np.float32(1e-10) / np.float32(448.0)] * 2,
    ]
    assert float(q[0, 3]) == -448.0 and float(q[0, 200]) == 448.0
    assert not np.any(np.asarray(q[1], np.float32))


@dataclasses.dataclass(frozen=True)
class BlockProblem:
    name: str
    shape: tuple[int, ...]
    block_shape: tuple[int, int] = (128, 128)

    def __str__(self):
        return self.name


BLOCK_PROBLEMS = [
    BlockProblem("N256_K128", (256, 128)),
    BlockProblem("E2_N256_K384", (2, 256, 384)),
    BlockProblem("E3_N128_K256", (3, 128, 256)),
    BlockProblem("E2_N128_K96_b64x32", (2, 128, 96), block_shape=(64, 32)),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("problem", BLOCK_PROBLEMS, ids=str)
def test_per_block_quant_fp8_is_bitwise_the_oracle(problem, dtype):
    rng = np.random.default_rng(oracles.seed("block", str(problem), dtype))
    w = rng.standard_normal(problem.shape) * np.exp2(rng.integers(-10, 4, problem.shape))
    w = w.astype(DTYPES[dtype])
    q, s = jax.jit(lambda a: quant.per_block_quant_fp8(a, problem.block_shape))(jnp.asarray(w))
    ref_q, ref_s = oracles.per_block_quant_fp8(w, problem.block_shape)
    assert s.shape == quant.block_scale_shape(w.shape, problem.block_shape) == ref_s.shape
    np.testing.assert_array_equal(_bits(q), _bits(ref_q))
    np.testing.assert_array_equal(_bits(s), _bits(ref_s))


def test_each_tile_has_its_own_scale():
    w = np.ones((256, 256), np.float32)
    w[255, 128] = 7.0  # in the bottom-right tile
    _, s = quant.per_block_quant_fp8(jnp.asarray(w))
    np.testing.assert_array_equal(
        np.asarray(s) * 448, np.array([[1.0, 1.0], [1.0, 7.0]], np.float32)
    )


@pytest.mark.parametrize(
    "shape,match",
    [
        # H = 96: w1 [E, 2I, H] has K = 96, which fused_moe would refuse only later
        pytest.param((2, 256, 96), r"K \(the columns: H of w1, I of w2\) = 96", id="w1_H96"),
        pytest.param((2, 96, 128), r"N \(the rows: 2I of w1, H of w2\) = 96", id="w2_H96"),
        pytest.param((2, 128, 200), r"K .* = 200 is not a multiple of the tile's 128", id="I200"),
    ],
)
def test_sizes_fused_moe_cannot_run_are_refused_when_quantized(shape, match):
    """fused_moe's FP8 path needs H and I multiples of 128: the quantizer refuses the rest,
    naming the dimension, instead of making scales that fused_moe refuses later."""
    with pytest.raises(ValueError, match=match):
        quant.per_block_quant_fp8(jnp.ones(shape))


@pytest.mark.parametrize("problem", GROUP_PROBLEMS[:4], ids=str)
def test_group_dequant_round_trip(problem):
    rng = np.random.default_rng(oracles.seed("rt_group", str(problem)))
    x = _activations(problem.shape, "float32", rng)
    q, s = quant.per_token_group_quant_fp8(jnp.asarray(x))
    back = quant.dequant_per_token_group(q, s)
    assert back.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(back), oracles.dequant_per_token_group(q, s), rtol=1e-7, atol=0
    )
    amax = np.repeat(np.asarray(s) * 448, 128, axis=-1)
    assert np.all(np.abs(np.asarray(back) - x) <= ROUND_TRIP_RTOL * amax)


@pytest.mark.parametrize("problem", BLOCK_PROBLEMS, ids=str)
def test_block_dequant_round_trip(problem):
    rng = np.random.default_rng(oracles.seed("rt_block", str(problem)))
    w = rng.standard_normal(problem.shape).astype(np.float32)
    q, s = quant.per_block_quant_fp8(jnp.asarray(w), problem.block_shape)
    back = quant.dequant_per_block(q, s, problem.block_shape)
    np.testing.assert_allclose(
        np.asarray(back), oracles.dequant_per_block(q, s, problem.block_shape), rtol=1e-7, atol=0
    )
    bn, bk = problem.block_shape
    amax = np.repeat(np.repeat(np.asarray(s) * 448, bn, -2), bk, -1)[..., : w.shape[-2], :]
    assert np.all(np.abs(np.asarray(back) - w) <= ROUND_TRIP_RTOL * amax[..., : w.shape[-1]])


def test_fp8_block_quant_config():
    cfg = quant.Fp8BlockQuant()
    assert cfg.group_size == 128
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 256)), jnp.bfloat16)
    q, s = cfg.quantize_activations(x)
    ref_q, ref_s = oracles.per_token_group_quant_fp8(np.asarray(x))
    np.testing.assert_array_equal(_bits(q), _bits(ref_q))
    np.testing.assert_array_equal(_bits(s), _bits(ref_s))
    with pytest.raises(ValueError, match=r"block_shape"):
        quant.Fp8BlockQuant(block_shape=(64, 128))


FP8_ONES = jnp.ones((2, 256), jnp.float8_e4m3fn)
GROUP, BLOCK = quant.per_token_group_quant_fp8, quant.per_block_quant_fp8
BAD_INPUTS = {  # id: (call, error, message)
    "group_H_100": (lambda: GROUP(jnp.ones((2, 100))), ValueError, r"H=100 must be a multiple"),
    "group_int": (lambda: GROUP(jnp.ones((2, 128), jnp.int32)), TypeError, r"x\.dtype"),
    "group_fp8": (lambda: GROUP(FP8_ONES), TypeError, r"x\.dtype"),
    "group_size_0": (lambda: GROUP(jnp.ones((2, 128)), 0), ValueError, "group_size=0"),
    "block_int": (lambda: BLOCK(jnp.ones((4, 4), jnp.int8)), TypeError, r"w\.dtype"),
    "dequant_group_rows": (
        lambda: quant.dequant_per_token_group(FP8_ONES, jnp.ones((3, 2))),
        ValueError,
        r"q\.shape.*scales\.shape",
    ),
    "dequant_block_shape": (
        lambda: quant.dequant_per_block(jnp.ones((256, 256), jnp.float8_e4m3fn), jnp.ones((2, 1))),
        ValueError,
        "scales",
    ),
}


@pytest.mark.parametrize(("call", "error", "match"), BAD_INPUTS.values(), ids=list(BAD_INPUTS))
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()
