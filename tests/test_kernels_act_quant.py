"""FP8 group quantization kernels (alone and fused after act(gate) * up) vs references and the
float64 NumPy oracles.

Interpret mode and the compiled kernel run one kernel body. The quantization's roundings (the
scale and quotient divisions, correctly rounded; the casts to the activation dtype and to e4m3,
round-to-nearest-even) are the same functions in both modes, spelled per backend in
`moe_jax.kernels.act_quant._divide_by_rows` / `_divide` / `_round`. So on the CPU,
`pallas_interpret` bitwise equal to the reference covers the compiled quantization, except:

- the spellings themselves (the compiled inline PTX and Triton's casts). The compiled quotient
  is a reciprocal per row corrected by FMAs (`_DIVIDE_ASM`): the tests at the end of this module
  run that PTX instruction by instruction in NumPy and hold it to float32 division on 3.8e5
  pairs, and lower the kernels for CUDA. The GPU-marked tests check the compiled kernels bitwise
  against the reference, for `group_quant` and for `act_and_quant` on inputs whose activation
  is exact, and the two `ActQuantConfig.division` spellings against each other;
- the activation's float32 arithmetic (`exp` and silu's division), which Triton lowers to its own
  GPU instructions: on random inputs the compiled act + quant kernel is held to one FP8 step of
  the reference, not bitwise.
"""

import dataclasses
import math
import shutil
import subprocess
from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import oracles
import pytest

from moe_jax.act_quant import act_and_quant_reference, group_quant_reference
from moe_jax.kernels.act_quant import (
    _DIVIDE_ASM,
    _ROW_FACTOR_ASM,
    _ROW_RECIPROCAL_ASM,
    _ROW_SCALED_ASM,
    COMPILED_ACTIVATIONS,
    ActQuantConfig,
    act_and_quant,
    group_quant,
)

pytestmark = pytest.mark.cpu_numerics  # XLA:CPU rounding (conftest.py)

IMPLS = [
    pytest.param("reference"),
    pytest.param("pallas_interpret"),
    pytest.param("pallas", marks=pytest.mark.gpu),
]


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


def _run_act(impl, h, activation, **kwargs):
    if impl == "pallas" and activation not in COMPILED_ACTIVATIONS:
        with pytest.raises(NotImplementedError, match="Triton cannot lower erf"):
            act_and_quant(h, activation=activation)
        pytest.skip(f"{activation} has no compiled kernel (checked that it says so)")
    if impl == "reference":
        return jax.jit(act_and_quant_reference, static_argnames="activation")(
            h, activation=activation
        )
    return act_and_quant(h, activation=activation, interpret=impl == "pallas_interpret", **kwargs)


def _run_group(impl, x, **kwargs):
    if impl == "reference":
        return jax.jit(group_quant_reference)(x)
    return group_quant(x, interpret=impl == "pallas_interpret", **kwargs)


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
    got = _run_act(impl, h, "silu", config=ActQuantConfig(block_m=16))
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
    """Every implementation divides correctly rounded (the compiled kernel by `_DIVIDE_ASM`), so
    all of them equal the float32 NumPy recipe, and so the reference, bit for bit."""
    x = _inputs(problem, scale=5.0, salt=4)
    q, scales = _run_group(impl, x, config=None if impl == "reference" else ActQuantConfig())
    assert q.shape == x.shape and scales.shape == (problem.rows, x.shape[1] // 128)
    q_ref, s_ref = oracles.per_token_group_quant_fp8(np.asarray(x.astype(jnp.float32)))
    _assert_bitwise((q, scales), (jnp.asarray(q_ref), s_ref))
    _assert_bitwise((q, scales), _xla_reference(group_quant_reference, x))


TILE_CONFIGS = [
    ActQuantConfig(block_m=16, groups_per_program=2),
    ActQuantConfig(block_m=64, num_warps=8, groups_per_program=4, is_group_major=True),
    ActQuantConfig(block_m=16, groups_per_program=8, is_group_major=True),  # clipped below
]


@pytest.mark.parametrize("impl", IMPLS[1:])
@pytest.mark.parametrize(
    "config",
    TILE_CONFIGS,
    ids=lambda c: f"bm{c.block_m}-w{c.num_warps}-g{c.groups_per_program}-gm{c.is_group_major:d}",
)
def test_every_tiling_quantizes_the_same_bits(impl, config):
    """Several groups per program and either grid order only move where a group is computed: the
    same bits as the reference, for the fused kernel (I of 2 and 3 groups: an odd count clips
    the tile to one group) and for the group quantization (4 and 6 groups), on row counts that
    do not fill the last block."""
    for problem in (Problem(77, 256, "bfloat16", seed=6), Problem(33, 384, "float32", seed=7)):
        h = _inputs(problem, scale=4.0, salt=2)
        got = _run_act(impl, h, "silu", config=config)
        want = _xla_reference(act_and_quant_reference, h)
        if impl == "pallas":
            _assert_within_one_step(*got, *map(np.asarray, want), max_flips=0.01)
        else:
            _assert_bitwise(got, want)
        x = _inputs(problem, scale=5.0, salt=4)
        _assert_bitwise(
            _run_group(impl, x, config=config), _xla_reference(group_quant_reference, x)
        )


@pytest.mark.parametrize("impl", IMPLS[1:])
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
        act_and_quant(h, interpret=True, expert_ids=jnp.zeros(79, jnp.int32))


def _edge_rows(dtype, rows: int = 96, cols: int = 512) -> jax.Array:
    """Rows whose group amax runs from 2**-149 to 2**127, with zeros of both signs, subnormals,
    values far below the amax, and a few groups holding inf or NaN."""
    rng = np.random.default_rng(11)
    magnitude = 2.0 ** rng.uniform(-149, 127, (rows, cols // 128, 1))
    shape = (rows, cols // 128, 128)
    spread = 2.0 ** np.where(rng.random(shape) < 0.3, -rng.uniform(0, 60, shape), 0)
    x = (rng.standard_normal(shape) * magnitude * spread).reshape(rows, cols)
    x = np.clip(x, -np.finfo(np.float32).max, np.finfo(np.float32).max)
    special = rng.random(x.shape)
    x[special < 0.03] = 0.0
    x[(special >= 0.03) & (special < 0.06)] = -0.0
    x[(special >= 0.06) & (special < 0.09)] = 2.0**-140
    x[0, 5], x[1, 130], x[2, 300], x[3, 7] = np.inf, -np.inf, np.nan, -(2.0**-149)
    return jnp.asarray(x, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_both_divisions_give_the_same_bits(dtype):
    """`ActQuantConfig.division` changes how the compiled kernel divides, never a bit of q or
    the scales: random rows and edge rows (`_edge_rows`: inf, NaN, signed zeros, subnormals,
    amax from 2**-149 to 2**127), for both kernels."""
    for x in (_inputs(Problem(300, 512, dtype, seed=9), scale=4.0, salt=6), _edge_rows(dtype)):
        outs = {}
        for division in ("reciprocal", "div_rn"):
            config = ActQuantConfig(block_m=16, division=division)
            outs[division] = (group_quant(x, config=config), act_and_quant(x, config=config))
        for got, want in zip(outs["reciprocal"], outs["div_rn"], strict=True):
            q, s = (np.asarray(v) for v in got)
            q_ref, s_ref = (np.asarray(v) for v in want)
            np.testing.assert_array_equal(q.view(np.uint8), q_ref.view(np.uint8))
            np.testing.assert_array_equal(s.view(np.uint32), s_ref.view(np.uint32))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="multiple of 256"):
        act_and_quant(jnp.zeros((4, 200), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"x.shape=\(4, 200\)"):
        group_quant(jnp.zeros((4, 200), jnp.bfloat16))
    with pytest.raises(TypeError, match="h.dtype"):
        act_and_quant(jnp.zeros((4, 256), jnp.int32))
    with pytest.raises(ValueError, match="unknown activation"):
        act_and_quant(jnp.zeros((4, 256), jnp.bfloat16), activation="relu")
    with pytest.raises(ValueError, match="power of two"):
        ActQuantConfig(block_m=24)
    with pytest.raises(ValueError, match="groups_per_program=3"):
        ActQuantConfig(groups_per_program=3)
    with pytest.raises(ValueError, match="choose from"):
        ActQuantConfig(division="fast")


# --- The compiled kernel's division (`_DIVIDE_ASM`), emulated instruction by instruction ---------
#
# `_run_ptx` runs the kernel's own inline-PTX strings on NumPy arrays (registers as uint32 bit
# patterns), so editing the asm changes what these tests check. float32 multiply, reciprocal and
# division are NumPy's, which round to nearest even with subnormals (IEEE binary32, no FTZ); the
# FMA is `_fma_f32`, exact, and checked against `fractions.Fraction` arithmetic below.

_F32_MIN_NORMAL = 2.0**-126


def _fma_f32(x, y, z) -> np.ndarray:
    """float32 RN(x * y + z) with one rounding, vectorised (float32 arrays in, float32 out).

    x * y is exact in float64 (48 significant bits; |x * y| between 2**-298 and 2**256, inside
    float64's normal range). s + e = x * y + z exactly by TwoSum (Knuth; exact in binary64
    without overflow). Rounding s + e to float64 by round-to-odd (s, or its neighbour toward e
    when e != 0 and s's last bit is even) and then to float32 to nearest is the correct
    rounding of x * y + z: 53 >= 24 + 2 bits (Boldo and Melquiond, IEEE TC 57(4), 2008), and
    float64's grid is finer than float32's everywhere, subnormals included. Signed zeros and
    specials follow from float64's own IEEE arithmetic.
    """
    with np.errstate(all="ignore"):
        p = x.astype(np.float64) * y.astype(np.float64)
        z64 = z.astype(np.float64)
        s = p + z64
        p_part = s - z64
        e = (p - p_part) + (z64 - (s - p_part))
        to_odd = np.isfinite(s) & (e != 0) & (s.view(np.int64) % 2 == 0)
        s = np.where(to_odd, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
        return s.astype(np.float32)


def _round_f32(value: Fraction, *, zero_sign: float = 1.0) -> float:
    """The float32 nearest to `value` (ties to even), as a float; a zero gets `zero_sign`."""
    if value == 0:
        return math.copysign(0.0, zero_sign)
    magnitude = abs(value)
    exponent = max(magnitude.numerator.bit_length() - magnitude.denominator.bit_length(), -126)
    while Fraction(2) ** exponent > magnitude and exponent > -126:
        exponent -= 1
    ulp = Fraction(2) ** (exponent - 23)
    units, rest = divmod(magnitude / ulp, 1)
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and units % 2):
        units += 1
    return math.copysign(float(units * ulp), value)  # < 2**128 here: no overflow case


def _fma_f32_fraction(x: float, y: float, z: float) -> float:
    """float32 fma of finite float32 values by exact rational arithmetic (the slow oracle)."""
    product = Fraction(x) * Fraction(y)
    # An exact zero sum is -0 only when both terms are -0 (IEEE 754, round to nearest).
    both_negative_zero = product == 0 and z == 0 and math.copysign(1, x * y) < 0
    both_negative_zero &= math.copysign(1, z) < 0
    return _round_f32(product + Fraction(z), zero_sign=-1.0 if both_negative_zero else 1.0)


def _run_ptx(asm: str, num_outputs: int, *inputs, fma_calls=None) -> list[np.ndarray]:
    """Runs inline PTX (operands $0.. outputs, then inputs) on float32 arrays, elementwise."""
    regs = {
        f"${i + num_outputs}": np.asarray(v, np.float32).view(np.uint32)
        for i, v in enumerate(inputs)
    }
    shape = np.broadcast_shapes(*(v.shape for v in regs.values()))

    def value(operand):
        if operand in regs:
            return np.broadcast_to(regs[operand], shape)
        return np.full(shape, int(operand, 0), np.uint32)  # an integer immediate

    def f32(bits):
        return bits.view(np.float32)

    statements = asm.replace("{", ";").replace("}", ";").split(";")
    for statement in filter(None, (s.strip() for s in statements)):
        if statement.startswith(".reg"):
            continue
        op, operands = statement.split(None, 1)
        dst, *src = (o.strip() for o in operands.split(","))
        args = [value(o) for o in src]
        with np.errstate(all="ignore"):
            if op == "mul.rn.f32":
                out = f32(args[0]) * f32(args[1])
            elif op == "fma.rn.f32":
                out = _fma_f32(*map(f32, args))
                if fma_calls is not None:
                    fma_calls.append(tuple(f32(a).copy() for a in args))
            elif op == "div.rn.f32":
                out = f32(args[0]) / f32(args[1])
            elif op == "rcp.rn.f32":
                out = np.float32(1) / f32(args[0])
            elif op == "neg.f32":
                out = args[0] ^ np.uint32(0x80000000)
            elif op == "and.b32":
                out = args[0] & args[1]
            elif op == "or.b32":
                out = args[0] | args[1]
            elif op == "sub.u32":
                out = args[0] - args[1]  # wraps modulo 2**32, as PTX does
            elif op == "mov.b32":
                out = args[0]
            else:
                raise NotImplementedError(f"no emulation of PTX {op!r} (in {statement!r})")
        regs[dst] = np.ascontiguousarray(out).view(np.uint32)
    return [f32(regs[f"${i}"]) for i in range(num_outputs)]


def _kernel_division(a, b, *, fma_calls=None) -> np.ndarray:
    """The compiled kernel's a / b: the `_ROW_*_ASM` on b, `_DIVIDE_ASM` per element."""
    row = _row_operands(b)
    [quotient] = _run_ptx(_DIVIDE_ASM, 1, a, *row, fma_calls=fma_calls)
    return quotient


def _row_operands(b) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(s, b', y) of scales b, as the kernel's per-row asm makes them."""
    [factor] = _run_ptx(_ROW_FACTOR_ASM, 1, b)
    [scaled] = _run_ptx(_ROW_SCALED_ASM, 1, b)
    [reciprocal] = _run_ptx(_ROW_RECIPROCAL_ASM, 1, b, factor)
    return factor, scaled, reciprocal


def _scales(amax) -> np.ndarray:
    """The kernel's per-row scale: max(amax, 1e-10) / 448 in float32 (div.rn, correctly rounded)."""
    return np.maximum(amax, np.float32(1e-10)) / np.float32(448)


def _kernel_like_pairs(rng, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) as `_store_quantized` divides them: rows of 128 float32 or bf16 values, b = the
    row's scale. Row magnitudes 2**-149 .. 2**128 (1e-30 and 3e38 included); within rows,
    values down to 2**-60 of the row's largest, zeros of both signs and subnormals."""
    exponents = rng.uniform(-149, 129, num_rows)
    exponents[:4] = (math.log2(1e-30), math.log2(3e38), -140.0, 127.9)
    spread = np.where(rng.random((num_rows, 128)) < 0.3, rng.uniform(-60, 0, (num_rows, 128)), 0)
    rows = rng.standard_normal((num_rows, 128)) * 2.0 ** (exponents[:, None] + spread)
    rows = np.clip(rows, -np.finfo(np.float32).max, np.finfo(np.float32).max)
    special = rng.random(rows.shape)
    rows[special < 0.02] = 0.0
    rows[(special >= 0.02) & (special < 0.04)] = -0.0
    subnormal = (special >= 0.04) & (special < 0.08)
    rows[subnormal] = rng.integers(-(2**23), 2**23, subnormal.sum()) * 2.0**-149
    rows = rows.astype(np.float32)
    is_bf16 = np.arange(num_rows) % 2 == 1
    rows[is_bf16] = rows[is_bf16].astype(ml_dtypes.bfloat16).astype(np.float32)
    b = _scales(np.abs(rows).max(axis=1))
    return rows.ravel(), np.repeat(b, 128)


def _near_midpoint_pairs(rng, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Quotients as close to a float32 rounding midpoint as 24-bit operands allow: significands
    A / B = (M + d / B) / 2**25 for odd M and |d| <= 3 (B = +-M^-1 mod 2**25 makes M * B + d a
    multiple of 2**25), and B whose reciprocal sits near a midpoint (B * M ~ 2**48), the
    reciprocal's own hardest rounding. Scaled to kernel ranges: b in [2**-43, 2**119], a / b
    of magnitude 2**-126 .. 256."""
    pairs = []
    while len(pairs) < count:
        m = int(rng.integers(2**24, 2**25)) | 1
        d = int(rng.integers(-3, 4))
        if rng.random() < 0.5:
            b_sig = (pow(m, -1, 2**25) * -d) % 2**25 if d else 0
        else:
            b_sig = round(2**48 / m) + int(rng.integers(-2, 3))
        if not 2**23 <= b_sig < 2**24:
            continue
        a_sig = round(m * b_sig / 2**25)
        if not 2**23 <= a_sig < 2**24:
            continue
        b_exp = int(rng.integers(-43, 119))
        q_exp = int(rng.integers(-125, 8))
        sign = 1 if rng.random() < 0.5 else -1
        pairs.append((sign * a_sig * 2.0 ** (b_exp + q_exp - 23), b_sig * 2.0 ** (b_exp - 23)))
    a, b = np.array(pairs).T
    return a.astype(np.float32), b.astype(np.float32)


def _bits_u32(x) -> str:
    return f"{int(np.asarray(x, np.float32).view(np.uint32)):#010x}"


# (a, b) bit patterns: 1.0175428e-17 / 4.958485e+22 = 292889 * 2**-150, a tie of the subnormal
# grid; -3.6083072e-25 / 1.0555312e+14, a subnormal quotient one correction step gets wrong.
_SUBNORMAL_TIE = (0x233BB41A, 0x65280000)
_ONE_STEP_MISS = (0x96DF57E9, 0x56C00000)


def _special_pairs() -> tuple[np.ndarray, np.ndarray]:
    """Zeros, the extreme scales (1e-10 / 448 and FLT_MAX / 448), subnormal and largest a, b =
    inf (a group holding an inf) with finite and infinite a, NaN a, and the pairs named above;
    only pairs a kernel meets (|a| <= the group's amax, about 448 * b)."""
    big = np.finfo(np.float32).max
    scales = [_scales(np.float32(0)), _scales(np.float32(big)), np.float32(1), np.float32(np.inf)]
    values = [0.0, -0.0, 2.0**-149, -(2.0**-149), 2.0**-126, 1e-30, -3e38, big, 448.0, 1e-10]
    values += [np.nan, np.inf, -np.inf]
    a, b = (v.ravel() for v in np.meshgrid(np.float32(values), np.float32(scales)))
    with np.errstate(invalid="ignore"):
        kept = np.isnan(a) | np.isinf(b) | (np.abs(a) <= np.minimum(448 * b.astype(float), big))
    named = np.array([_SUBNORMAL_TIE, _ONE_STEP_MISS], np.uint32).view(np.float32)
    return np.concatenate([a[kept], named[:, 0]]), np.concatenate([b[kept], named[:, 1]])


def _division_pairs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(20261208)
    parts = [_kernel_like_pairs(rng, 2400), _near_midpoint_pairs(rng, 20_000), _special_pairs()]
    # Subnormal quotients: any scale, |a / b| from 2**-150 to 2**-120.
    b = (2.0 ** rng.uniform(-43, 119, 50_000)).astype(np.float32)
    a = 2.0 ** rng.uniform(-150, -120, 50_000) * rng.choice([-1.0, 1.0], 50_000) * b
    parts.append((a.astype(np.float32), b))
    return tuple(np.concatenate(p) for p in zip(*parts, strict=True))


def _e4m3_codes(q, *, upper_clip: bool = False) -> np.ndarray:
    """The FP8 bytes `_store_quantized` writes for float32 quotients q: max(q, -448) as
    Triton's NaN-ignoring `maxnumf` takes it (NaN becomes -448, `np.fmax`), cast to e4m3 with
    round-to-nearest-even; `upper_clip` also takes min(., 448), the reference's full clip."""
    clipped = np.fmax(q, np.float32(-448))
    if upper_clip:
        clipped = np.fmin(clipped, np.float32(448))
    return clipped.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def test_fma_emulation_is_exact():
    """`_fma_f32` against exact rationals, on the FMA operands the kernel's division meets and
    on double-rounding traps where rounding x * y + z to float64 first would be wrong."""
    a, b = _division_pairs()
    pick = np.random.default_rng(1).choice(a.size, 3000, replace=False)
    keep = np.isfinite(a[pick]) & np.isfinite(b[pick])
    calls = []
    _kernel_division(a[pick][keep], b[pick][keep], fma_calls=calls)
    x, y, z = (np.concatenate(v) for v in zip(*calls, strict=True))
    one = 1 + 2.0**-12  # one * one = 1 + 2**-11 + 2**-24: a float32 tie, broken by z below
    x = np.concatenate([x, np.float32([one, one, one, 2.0**-75, -1.0])])
    y = np.concatenate([y, np.float32([one, one, one, 2.0**-75, 2.0**-149])])
    z = np.concatenate([z, np.float32([0.0, 2.0**-60, -(2.0**-60), 2.0**-149, 2.0**-149])])
    got = _fma_f32(x, y, z)
    want = np.array([_fma_f32_fraction(*map(float, t)) for t in zip(x, y, z, strict=True)])
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
    # The trap: the tie rounds to even (down) alone and up with z = 2**-60; rounding to float64
    # first loses z (below float64's half ulp at 1) and rounds that one down too.
    naive = (x.astype(np.float64) * y + z).astype(np.float32)
    assert got[-4] > got[-5] == got[-3] == naive[-4]


def test_kernel_division_is_correctly_rounded():
    """The kernel's reciprocal division equals float32 a / b: bit for bit for every quotient of
    normal magnitude; for subnormal quotients (which the FP8 cast sends to a signed zero) the
    same sign and FP8 code, and float32 bits that differ only at exact ties."""
    a, b = _division_pairs()
    got = _kernel_division(a, b)
    with np.errstate(all="ignore"):
        want = a / b
    assert a.size > 300_000
    is_nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), is_nan)
    normal = ~is_nan & (np.abs(want) >= _F32_MIN_NORMAL)
    np.testing.assert_array_equal(got[normal].view(np.uint32), want[normal].view(np.uint32))
    np.testing.assert_array_equal(np.signbit(got[~is_nan]), np.signbit(want[~is_nan]))
    np.testing.assert_array_equal(_e4m3_codes(got), _e4m3_codes(want))
    for i in np.nonzero(~is_nan & (got.view(np.uint32) != want.view(np.uint32)))[0]:
        quotient = Fraction(float(a[i])) / Fraction(float(b[i])) * 2**150
        assert quotient.denominator == 1 and quotient.numerator % 2, (
            f"a={_bits_u32(a[i])} b={_bits_u32(b[i])}: {got[i]!r} but {want[i]!r}, not a tie"
        )
    tie = np.array(_SUBNORMAL_TIE, np.uint32).view(np.float32)
    assert _kernel_division(tie[:1], tie[1:])[0] != tie[0] / tie[1]  # the documented tie


def test_kernel_division_keeps_the_upper_clip_a_no_op():
    """`_store_quantized` clips below only: on kernel-like rows |a / scale| stays within
    448 + ulp(448), which the e4m3 cast rounds to 448 anyway."""
    a, b = _kernel_like_pairs(np.random.default_rng(3), 2400)
    q = _kernel_division(a, b)
    assert np.nanmax(np.abs(q)) <= np.float32(448) + np.float32(2.0**-15)  # NaN: inf rows
    assert np.any(np.abs(q) > 448)  # the case exists
    np.testing.assert_array_equal(_e4m3_codes(q), _e4m3_codes(q, upper_clip=True))


# Weaker spellings the checks above must reject. a * RN(1 / b) alone; the two corrections
# without the row scaling (b' = b: residuals underflow); one correction instead of two.
_RECIPROCAL_ONLY = "{ .reg .f32 y; rcp.rn.f32 y, $2; mul.rn.f32 $0, $1, y; }"
_UNSCALED = """{ .reg .f32 y, na, q, r; rcp.rn.f32 y, $2; neg.f32 na, $1; mul.rn.f32 q, $1, y;
fma.rn.f32 r, $2, q, na; neg.f32 r, r; fma.rn.f32 q, r, y, q;
fma.rn.f32 r, $2, q, na; neg.f32 r, r; fma.rn.f32 $0, r, y, q; }"""
_ONE_STEP = """{ .reg .f32 sa, na, q, r; mul.rn.f32 sa, $1, $2; neg.f32 na, sa;
mul.rn.f32 q, sa, $4; fma.rn.f32 r, $3, q, na; neg.f32 r, r; fma.rn.f32 $0, r, $4, q; }"""


def test_weaker_divisions_fail_these_checks():
    """The checks can fail: a * RN(1 / b) misses float32 quotients by the thousand and FP8
    codes too; without the row scaling, quotients of normal magnitude are missed; one
    correction misses the subnormal quotient `_ONE_STEP_MISS` that two get right."""
    a, b = _division_pairs()
    with np.errstate(all="ignore"):
        want = a / b
    normal = np.isfinite(want) & (np.abs(want) >= _F32_MIN_NORMAL)

    def misses(got, where):
        return np.sum(got[where].view(np.uint32) != want[where].view(np.uint32))

    [reciprocal_only] = _run_ptx(_RECIPROCAL_ONLY, 1, a, b)
    assert misses(reciprocal_only, normal) > 1000
    assert np.any(_e4m3_codes(reciprocal_only) != _e4m3_codes(want))
    assert misses(*_run_ptx(_UNSCALED, 1, a, b), normal) > 1000
    [one_step] = _run_ptx(_ONE_STEP, 1, a, *_row_operands(b))
    miss = np.array(_ONE_STEP_MISS, np.uint32).view(np.float32)
    assert one_step[(a == miss[0]) & (b == miss[1])] != miss[0] / miss[1]
    np.testing.assert_array_equal(_kernel_division(miss[:1], miss[1:]), miss[:1] / miss[1:])


@pytest.mark.parametrize("division", ["reciprocal", "div_rn"])
def test_compiled_kernels_lower_for_cuda_with_either_division(division):
    """Both spellings lower to Triton for CUDA on any host (nothing runs), the reciprocal one
    with `_DIVIDE_ASM` in the kernel and no per-element div.rn."""
    config = ActQuantConfig(block_m=16, division=division)
    texts = []
    for fn, shape in ((group_quant, (40, 256)), (act_and_quant, (40, 512))):
        x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        lowered = jax.jit(lambda v, fn=fn: fn(v, config=config)).trace(x)
        texts.append(lowered.lower(lowering_platforms=("cuda",)).as_text())
    for text in texts:
        assert ("fma.rn.f32 $0, r, $4, q;" in text) == (division == "reciprocal")
        assert ("rcp.rn.f32 $0, bs;" in text) == (division == "reciprocal")
        assert "_divrn" in text if division == "div_rn" else "_divrn" not in text


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
def test_division_ptx_assembles_for_sm90(tmp_path):
    """ptxas accepts the division's asm blocks, inlined as Triton inlines them (operands
    substituted, each block in its own scope)."""

    def inline(code, *regs):
        for i, reg in enumerate(regs):
            code = code.replace(f"${i}", reg)
        return code

    ptx = "\n".join(
        [
            ".version 8.0",
            ".target sm_90",
            ".address_size 64",
            ".visible .entry division(.param .u64 p, .param .f32 b) {",
            ".reg .u64 %rd<2>; .reg .f32 %f<7>;",
            "ld.param.u64 %rd1, [p]; ld.param.f32 %f4, [b]; ld.global.f32 %f5, [%rd1];",
            inline(_ROW_FACTOR_ASM, "%f1", "%f4"),
            inline(_ROW_SCALED_ASM, "%f2", "%f4"),
            inline(_ROW_RECIPROCAL_ASM, "%f3", "%f4", "%f1"),
            inline(_DIVIDE_ASM, "%f6", "%f5", "%f1", "%f2", "%f3"),
            "st.global.f32 [%rd1], %f6;",
            "ret;",
            "}",
            "",
        ]
    )
    (tmp_path / "division.ptx").write_text(ptx)
    result = subprocess.run(
        ["ptxas", "-arch=sm_90", str(tmp_path / "division.ptx"), "-o", str(tmp_path / "d.cubin")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
