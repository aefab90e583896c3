"""FP8 group quantization kernels (alone and fused after act(gate) * up) vs references and the
float64 NumPy oracles.

Interpret mode and the compiled kernel run one kernel body. The quantization's roundings (the
scale and quotient divisions, correctly rounded; the casts to the activation dtype and to e4m3,
round-to-nearest-even) are the same functions in both modes, spelled per backend in
`moe_jax.kernels.act_quant._divide` / `_round`. So on the CPU, `pallas_interpret` bitwise equal to
the reference covers the compiled quantization, except:

- the two spellings themselves (the compiled `div.rn.f32` inline PTX and Triton's casts): the
  GPU-marked tests check them, bitwise against the reference, for `group_quant` and for
  `act_and_quant` on inputs whose activation is exact;
- the activation's float32 arithmetic (`exp` and silu's division), which Triton lowers to its own
  GPU instructions: on random inputs the compiled act + quant kernel is held to one FP8 step of
  the reference, not bitwise.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest
from contract import impl_params, runs_or_skip

from moe_jax import act_quant as act_quant_front
from moe_jax import quant
from moe_jax.act_quant import COMPILED_ACTIVATIONS, act_and_quant_reference, group_quant_reference
from moe_jax.kernels.act_quant import ActQuantConfig, act_and_quant, group_quant
from moe_jax.registry import OpProblem, current_platform

pytestmark = pytest.mark.cpu_numerics  # XLA:CPU rounding (conftest.py)

# Every name of the op (act + quant and the token quantization list the same), interpret twins
# too; the config tests run the Pallas kernel itself.
IMPLS = impl_params(act_quant_front.ACT_QUANTS)
KERNELS = [pytest.param("pallas_interpret"), pytest.param("pallas", marks=pytest.mark.gpu)]


@dataclasses.dataclass(frozen=True)
class Problem:
    rows: int
    inter: int
    dtype: str
    seed: int

    def __str__(self):
        return f"M{self.rows}-I{self.inter}-{self.dtype}"


PROBLEMS = [
    Problem(1, 128, "bfloat16", seed=1),
    Problem(77, 256, "bfloat16", seed=2),
    Problem(40, 384, "float32", seed=3),
    Problem(33, 128, "float16", seed=4),
    Problem(0, 128, "bfloat16", seed=5),
]


def _inputs(problem: Problem, *, scale: float, salt: int) -> jax.Array:
    rng = np.random.default_rng(problem.seed * 10 + salt)
    return jnp.asarray(
        rng.standard_normal((problem.rows, 2 * problem.inter)) * scale, problem.dtype
    )


def _run_act(impl, h, activation, *, config=None, **kwargs):
    """The front's `impl` (skipped with its reason where it cannot run here), or with a config
    the kernel itself."""
    platform = current_platform()
    if impl == "pallas" and platform == "gpu" and activation not in COMPILED_ACTIVATIONS:
        with pytest.raises(NotImplementedError, match="Triton cannot lower erf"):
            act_quant_front.act_and_quant(h, activation=activation, impl=impl)
        pytest.skip(f"{activation} has no compiled kernel (checked that it says so)")
    if config is None:
        dtype = jnp.dtype(h.dtype).name
        problem = OpProblem(platform=platform, dtype=dtype, activation=activation)
        runs_or_skip(act_quant_front.ACT_QUANTS.get(impl), problem)
        return act_quant_front.act_and_quant(h, activation=activation, impl=impl, **kwargs)
    interpret = impl == "pallas_interpret"
    return act_and_quant(h, activation=activation, config=config, interpret=interpret, **kwargs)


def _run_group(impl, x, *, config=None):
    """As `_run_act`, for the token quantization."""
    if config is None:
        problem = OpProblem(platform=current_platform(), dtype=jnp.dtype(x.dtype).name)
        runs_or_skip(act_quant_front.GROUP_QUANTS.get(impl), problem)
        return act_quant_front.group_quant(x, impl=impl)
    return group_quant(x, config=config, interpret=impl == "pallas_interpret")


def _xla_reference(fn, x):
    """`fn(x)` jitted on the CPU device: the XLA recipe with correctly rounded float32 division,
    also when the implementation under test is the compiled kernel on a GPU."""
    with jax.default_device(jax.devices("cpu")[0]):
        return jax.jit(fn)(x)


def _codes(q) -> np.ndarray:
    return np.asarray(q.astype(jnp.float32))


def _assert_bitwise(got, want):
    (q, s), (q_ref, s_ref) = got, want
    np.testing.assert_array_equal(_codes(q), _codes(q_ref))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))


def _assert_within_one_step(q, scales, q_ref, s_ref, *, max_flips: float):
    """Scales within float32 rounding; every code within one e4m3 step of the oracle's, and at
    most `max_flips` of them different."""
    np.testing.assert_allclose(np.asarray(scales), s_ref, rtol=1e-6)
    codes, codes_ref = _codes(q), np.asarray(q_ref).astype(np.float32)
    step = 0.125 * np.abs(codes_ref) + 2.0**-9
    assert np.all(np.abs(codes - codes_ref) <= step)
    assert np.sum(codes != codes_ref) <= max_flips * codes_ref.size


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
def test_act_and_quant_matches_oracle(impl, activation, problem):
    h = _inputs(problem, scale=4.0, salt=1)
    q, scales = _run_act(impl, h, activation)
    assert q.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float32
    assert q.shape == (problem.rows, problem.inter)
    assert scales.shape == (problem.rows, problem.inter // 128)
    # The oracle's activation is float64: a float32 activation can land on the other side of a
    # bf16 rounding boundary, moving that code by one step (about 1% of codes at most).
    a = oracles.act_and_mul(np.asarray(h.astype(jnp.float32)), activation, jnp.dtype(h.dtype))
    q_ref, s_ref = oracles.per_token_group_quant_fp8(a.astype(np.float32))
    _assert_within_one_step(q, scales, q_ref, s_ref, max_flips=0.01)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
def test_act_and_quant_kernel_is_bitwise_reference(impl, problem):
    """Bitwise on random inputs where the body's arithmetic is shared: interpret mode always.
    The compiled kernel's activation is Triton's own (module docstring): one step allowed."""
    h = _inputs(problem, scale=4.0, salt=2)
    got = _run_act(impl, h, "silu")
    want = _xla_reference(act_and_quant_reference, h)
    if impl == "pallas":
        _assert_within_one_step(*got, *map(np.asarray, want), max_flips=0.01)
    else:
        _assert_bitwise(got, want)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("problem", PROBLEMS[:4], ids=str)
def test_act_and_quant_rounding_is_bitwise_where_the_activation_is_exact(impl, problem):
    """silu(g) == g exactly for g >= 20 (1 + exp(-g) rounds to 1) and silu(0) == 0, on any
    hardware. So the product's rounding and the quantization, the arithmetic the two modes share,
    must match the reference bit for bit, compiled kernel included."""
    rng = np.random.default_rng(problem.seed * 10 + 3)
    gate = rng.uniform(20.0, 40.0, (problem.rows, problem.inter))
    gate[rng.random(gate.shape) < 0.25] = 0.0
    up = rng.standard_normal((problem.rows, problem.inter)) * 3
    h = jnp.asarray(np.concatenate([gate, up], axis=1), problem.dtype)
    got = _run_act(impl, h, "silu")
    _assert_bitwise(got, _xla_reference(act_and_quant_reference, h))
    a = oracles.act_and_mul(np.asarray(h.astype(jnp.float32)), "silu", jnp.dtype(h.dtype))
    q_ref, s_ref = oracles.per_token_group_quant_fp8(a.astype(np.float32))
    _assert_bitwise(got, (jnp.asarray(q_ref), s_ref))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
def test_group_quant_is_bitwise_the_oracle(impl, problem):
    """Every implementation divides correctly rounded (the compiled kernel by `div.rn.f32`), so
    all of them equal the float32 NumPy recipe, and so the reference, bit for bit."""
    x = _inputs(problem, scale=5.0, salt=4)
    q, scales = _run_group(impl, x)
    assert q.shape == x.shape and scales.shape == (problem.rows, x.shape[1] // 128)
    q_ref, s_ref = oracles.per_token_group_quant_fp8(np.asarray(x.astype(jnp.float32)))
    _assert_bitwise((q, scales), (jnp.asarray(q_ref), s_ref))
    _assert_bitwise((q, scales), _xla_reference(group_quant_reference, x))


def _quotients_near_e4m3_ties(seed: int) -> np.ndarray:
    """float32 [48, 256] rows whose quotients x / scale land within a few float32 ulps of e4m3
    rounding ties (and on them), so a quotient one ulp off its correct rounding flips a code;
    plus -0.0, subnormals, all-zero groups (scale from the 1e-10 floor), amax just above and
    below the floor, and amax near float32's top (1e38)."""
    rng = np.random.default_rng(seed)
    e4m3 = np.unique(
        np.abs(np.arange(256, dtype=np.uint8).view(quant.FP8_DTYPE).astype(np.float32))
    )
    e4m3 = e4m3[np.isfinite(e4m3)]
    ties = (e4m3[:-1] + e4m3[1:]) / 2  # halfway between neighbouring codes
    amaxes = [1.0, 3.7, 1e-3, 6.1e4, 1e-10, 1.5e-10, 7e-11, 1e38, 2.5e-30, 448.0]
    rows = []
    for i in range(48):
        amax = np.float32(amaxes[i % len(amaxes)] * rng.uniform(0.5, 2.0))
        scale = np.float32(np.maximum(amax, np.float32(1e-10)) / np.float32(448.0))
        targets = rng.choice(ties, 127) * rng.choice([-1.0, 1.0], 127)
        row = (targets * np.float64(scale)).astype(np.float32)
        nudge = rng.integers(-3, 4, 127)  # a few ulps either side of each tie
        row = np.array([np.float32(v) for v in row])
        for _ in range(3):
            row = np.where(nudge > 0, np.nextafter(row, np.float32(np.inf)), row)
            row = np.where(nudge < 0, np.nextafter(row, np.float32(-np.inf)), row)
            nudge = nudge - np.sign(nudge)
        group = np.concatenate([[amax], np.clip(row, -amax, amax)]).astype(np.float32)
        other = np.zeros(128, np.float32) if i % 4 == 0 else rng.permutation(group)
        if i % 3 == 0:
            other[:8] = [-0.0, 1e-45, -1e-40, 1.2e-38, -0.0, 0.0, 1e-44, -3e-39]
        rows.append(np.concatenate([group, other]))
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_group_quant_divides_correctly_rounded_near_e4m3_ties(impl):
    """The compiled kernel's division (a reciprocal per row, one FMA correction per element,
    `_divide_rows`) against the float32 recipe where a quotient one ulp off would change a code
    (a plain multiply by the reciprocal changes 325 of these 12288 codes): bit for bit, codes
    and their signs (-0.0 included), and scales."""
    x = jnp.asarray(_quotients_near_e4m3_ties(seed=11))
    q, scales = _run_group(impl, x)
    q_ref, s_ref = oracles.per_token_group_quant_fp8(np.asarray(x))
    got_bits = np.asarray(q).view(np.uint8)
    np.testing.assert_array_equal(got_bits, q_ref.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scales), s_ref)
    assert np.any(got_bits == 0x80), "no -0.0 code: the sign of zero was not exercised"


def test_kernel_silu_by_exp2_is_silu():
    """The compiled kernel's silu spelling (exp through exp2) against float64 silu; on the CPU
    XLA's exp2 is accurate, so this checks the formula (the GPU's ex2.approx adds up to 2 ulp,
    which the compiled tests above bound through the FP8 codes)."""
    from moe_jax.kernels.act_quant import KERNEL_ACTIVATIONS

    x = np.concatenate(
        [
            np.random.default_rng(12).standard_normal(4096) * 6,
            [0.0, -0.0, 20.0, -20.0, 88.0, -104.0],
        ]
    ).astype(np.float32)
    got = np.asarray(jax.jit(KERNEL_ACTIVATIONS["silu"])(jnp.asarray(x)), np.float64)
    want = x.astype(np.float64) / (1.0 + np.exp(-x.astype(np.float64)))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-37)
    assert np.signbit(got[x.size - 5]) and got[x.size - 1] == 0.0


TILE_CONFIGS = [
    ActQuantConfig(block_m=16, groups_per_program=2),
    ActQuantConfig(block_m=64, num_warps=8, groups_per_program=4, is_group_major=True),
    ActQuantConfig(block_m=16, groups_per_program=8, is_group_major=True),  # clipped below
]


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("is_scales_group_major", [False, True], ids=["scales_rows", "scales_gm"])
@pytest.mark.parametrize(
    "config",
    TILE_CONFIGS,
    ids=lambda c: f"bm{c.block_m}-w{c.num_warps}-g{c.groups_per_program}-gm{c.is_group_major:d}",
)
def test_every_tiling_quantizes_the_same_bits(impl, is_scales_group_major, config):
    """Several groups per program, either grid order and either scales layout in memory only
    move where a value is computed or stored: the same bits as the reference, for the fused
    kernel (I of 2 and 3 groups: an odd count clips the tile to one group) and for the group
    quantization (4 and 6 groups), on row counts that do not fill the last block."""
    for problem in (Problem(77, 256, "bfloat16", seed=6), Problem(33, 384, "float32", seed=7)):
        h = _inputs(problem, scale=4.0, salt=2)
        got = _run_act(impl, h, "silu", config=config, is_scales_group_major=is_scales_group_major)
        want = _xla_reference(act_and_quant_reference, h)
        if impl == "pallas":
            _assert_within_one_step(*got, *map(np.asarray, want), max_flips=0.01)
        else:
            _assert_bitwise(got, want)
        x = _inputs(problem, scale=5.0, salt=4)
        _assert_bitwise(
            _run_group(impl, x, config=config), _xla_reference(group_quant_reference, x)
        )


@pytest.mark.parametrize("impl", KERNELS)
def test_padding_blocks_are_skipped_and_used_rows_unchanged(impl):
    """With the layout's expert ids, 16-row programs whose rows are all padding (-1) write
    nothing; a program with any used row computes all of its rows. Used rows equal the
    reference (bitwise in interpret mode; one FP8 step compiled, as above), and the skipped
    rows' scales are not what computing them gives (the buffer keeps whatever it held)."""
    problem = Problem(80, 256, "bfloat16", seed=8)
    h = _inputs(problem, scale=4.0, salt=5)
    ids = np.full(80, -1, np.int32)
    ids[0:21] = 0  # block 0 used, block 1 rows 16-20 used then padding
    ids[48:51] = 3  # block 3: three used rows; blocks 2 and 4 are all padding
    q, scales = act_and_quant(
        h,
        config=ActQuantConfig(block_m=16),
        interpret=impl == "pallas_interpret",
        expert_ids=jnp.asarray(ids),
    )
    q_ref, s_ref = map(np.asarray, _xla_reference(act_and_quant_reference, h))
    computed = np.zeros(80, bool)
    computed[0:32] = computed[48:64] = True
    got = (np.asarray(q)[computed], np.asarray(scales)[computed])
    if impl == "pallas":
        _assert_within_one_step(*got, q_ref[computed], s_ref[computed], max_flips=0.01)
    else:
        _assert_bitwise(got, (q_ref[computed], s_ref[computed]))
    assert not np.any(np.asarray(scales)[~computed] == s_ref[~computed])
    with pytest.raises(ValueError, match=r"expert_ids.shape=\(79,\)"):
        act_quant_front.act_and_quant(h, impl=impl, expert_ids=jnp.zeros(79, jnp.int32))


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_bad_inputs_raise(impl):
    """The fronts check once, whichever implementation quantizes."""
    act, group = (
        functools.partial(fn, impl=impl)
        for fn in (act_quant_front.act_and_quant, act_quant_front.group_quant)
    )
    with pytest.raises(ValueError, match="multiple of 256"):
        act(jnp.zeros((4, 200), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"h\.shape=\(4, 192\).*multiple of 256"):
        act(jnp.ones((4, 192)))
    for group_size in (0, -128):
        with pytest.raises(ValueError, match=f"group_size={group_size}"):
            group(jnp.ones((4, 256)), group_size=group_size)
    with pytest.raises(TypeError, match=r"group_size=2\.0 must be an int"):
        group(jnp.ones((4, 256)), group_size=2.0)
    with pytest.raises(ValueError, match=r"x.shape=\(4, 200\)"):
        group(jnp.zeros((4, 200), jnp.bfloat16))
    with pytest.raises(TypeError, match="h.dtype"):
        act(jnp.zeros((4, 256), jnp.int32))
    with pytest.raises(ValueError, match="unknown activation"):
        act(jnp.zeros((4, 256), jnp.bfloat16), activation="relu")
    with pytest.raises(ValueError, match="expert_ids"):
        act(jnp.zeros((4, 256), jnp.bfloat16), expert_ids=jnp.zeros(4, jnp.float32))


def test_config_rejects_bad_blocks():
    with pytest.raises(ValueError, match="power of two"):
        ActQuantConfig(block_m=24)
    with pytest.raises(ValueError, match="groups_per_program=3"):
        ActQuantConfig(groups_per_program=3)
