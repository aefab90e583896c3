"""`moe_jax.fused_moe` (and `ModularMoE` under it) against the float64 loop in `oracles.fused_moe`.

The oracle rounds where vLLM rounds (bf16 GEMM outputs, act*up in the activation dtype, FP8 block
quantization of both GEMM inputs), so each dtype is held to a tolerance close to its own rounding
(`oracles.MOE_TOL`). Ids outside [0, E) and expert_map holes, for every experts name, are
tests/test_contract_experts.py's; here the float32 layer, eager calls, chunking, weight on input,
gelu, the masked layout's capacity and the argument checks.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest
from oracles import MoeInputs, assert_moe_close, moe_inputs

from moe_jax import ContiguousExperts, ModularMoE, NoEPPrepareFinalize, experts_names, fused_moe
from moe_jax.reference import moe_reference

pytestmark = pytest.mark.cpu_numerics  # XLA:CPU rounding (conftest.py)

EXPERTS_BY_ID = {
    "xla": "xla",
    "xla_masked": "xla_masked",
    "pallas_interpret": ContiguousExperts(
        gemm="xla", permute_impl="pallas_interpret", act_quant_impl="pallas_interpret"
    ),
}
EXPERTS = [pytest.param(e, id=name) for name, e in EXPERTS_BY_ID.items()]


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    num_tokens: int
    hidden: int
    inter: int
    num_experts: int
    topk: int

    def __str__(self):
        return self.name

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return self.num_tokens, self.hidden, self.inter, self.num_experts, self.topk


FLOAT_PROBLEMS = [
    Problem("T1_H32_I16_E4_k2", 1, 32, 16, 4, 2),
    Problem("T7_H64_I32_E8_k3", 7, 64, 32, 8, 3),
    Problem("T13_H48_I24_E5_k4", 13, 48, 24, 5, 4),
]
FP8_PROBLEMS = [
    Problem("T5_H128_I128_E4_k2", 5, 128, 128, 4, 2),
    Problem("T9_H256_I128_E3_k3", 9, 256, 128, 3, 3),
]
# Shapes the special-case tests share, so their jitted programs compile once.
SMALL = Problem("T7_H32_I16_E4_k3", 7, 32, 16, 4, 3)
SMALL_K1 = dataclasses.replace(SMALL, name="T7_H32_I16_E4_k1", topk=1)
CASES = [
    *(pytest.param("float32", p, id=f"float32-{p}") for p in FLOAT_PROBLEMS),
    *(pytest.param("bfloat16", p, id=f"bfloat16-{p}") for p in FLOAT_PROBLEMS[1:]),
    *(pytest.param("fp8", p, id=f"fp8-{p}") for p in FP8_PROBLEMS),
]
EAGER_CASES = [
    pytest.param("float32", FLOAT_PROBLEMS[2], id=f"float32-{FLOAT_PROBLEMS[2]}"),
    pytest.param("bfloat16", FLOAT_PROBLEMS[0], id=f"bfloat16-{FLOAT_PROBLEMS[0]}"),
    pytest.param("fp8", FP8_PROBLEMS[0], id=f"fp8-{FP8_PROBLEMS[0]}"),
]


@functools.cache
def _jitted(**kwargs):
    """One jitted fused_moe per static configuration, so equal shapes compile once per session."""
    return jax.jit(functools.partial(fused_moe, **kwargs))


def run(inputs: MoeInputs, *, jit: bool, expert_map=None, **kwargs) -> np.ndarray:
    """fused_moe on jnp copies of `inputs`, eagerly or under jax.jit (arrays as jit arguments)."""
    fn = _jitted(**kwargs) if jit else functools.partial(fused_moe, **kwargs)
    out = fn(*inputs.args(), **inputs.scales(), expert_map=expert_map)
    assert out.dtype == inputs.x.dtype
    assert out.shape == inputs.x.shape
    return np.asarray(out)


@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("dtype,problem", CASES)
def test_fused_moe_matches_oracle_jitted(dtype, problem, experts):
    rng = np.random.default_rng(oracles.seed("jit", dtype, str(problem), str(experts)))
    inputs = moe_inputs(problem.shape, dtype, rng)
    assert_moe_close(run(inputs, jit=True, experts=experts), inputs.expected(), dtype)


@pytest.mark.parametrize("experts", ["xla", "xla_masked"])
@pytest.mark.parametrize("dtype,problem", EAGER_CASES)
def test_fused_moe_matches_oracle_eager(dtype, problem, experts):
    rng = np.random.default_rng(oracles.seed("eager", dtype, str(problem), experts))
    inputs = moe_inputs(problem.shape, dtype, rng)
    assert_moe_close(run(inputs, jit=False, experts=experts), inputs.expected(), dtype)


@pytest.mark.parametrize("experts", ["xla", "xla_masked"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_no_tokens(experts, jit):
    inputs = moe_inputs(SMALL.shape, "bfloat16", np.random.default_rng(0))
    inputs = dataclasses.replace(
        inputs, x=inputs.x[:0], topk_weights=inputs.topk_weights[:0], topk_ids=inputs.topk_ids[:0]
    )
    assert run(inputs, jit=jit, experts=experts, chunk_size=4).shape == (0, SMALL.hidden)


@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_apply_router_weight_on_input(dtype, experts):
    """k == 1: out = W2 act(W1 (w x)); differs from w * W2 act(W1 x) since act is nonlinear."""
    problem = dataclasses.replace(FP8_PROBLEMS[0], topk=1) if dtype == "fp8" else SMALL_K1
    rng = np.random.default_rng(oracles.seed("on_input", dtype, str(experts)))
    inputs = moe_inputs(problem.shape, dtype, rng)
    inputs.topk_weights *= 3.0  # far from 1 so the two orders differ clearly
    out = run(inputs, jit=True, experts=experts, apply_router_weight_on_input=True)
    assert_moe_close(out, inputs.expected(apply_router_weight_on_input=True), dtype)
    after = inputs.expected()
    assert not np.allclose(out.astype(np.float64), after, **oracles.MOE_TOL[dtype])


@pytest.mark.parametrize("experts", ["xla", "xla_masked"])
@pytest.mark.parametrize(
    "dtype,chunk_size",
    [("float32", 1), ("float32", 3), ("float32", 7), ("float32", 50), ("fp8", 2), ("bfloat16", 4)],
)
def test_chunking_matches_oracle(dtype, chunk_size, experts):
    """Chunk 1; uneven chunks (7 = 3+3+1, 7 = 4+3, 5 = 2+2+1); chunk == T; chunk > T."""
    problem = FP8_PROBLEMS[0] if dtype == "fp8" else SMALL
    rng = np.random.default_rng(oracles.seed("chunk", dtype, chunk_size, str(experts)))
    inputs = moe_inputs(problem.shape, dtype, rng, id_low=-1, id_high=problem.num_experts + 1)
    inputs.topk_ids[-1, :2] = 1  # duplicate in the tail chunk
    out = run(inputs, jit=True, experts=experts, chunk_size=chunk_size)
    assert_moe_close(out, inputs.expected(), dtype)


def test_chunked_expert_map_and_weight_on_input():
    """Chunking composes with an expert_map and weight-on-input (k = 1)."""
    expert_map = np.array([1, -1, 0, 3, 2, -1], np.int32)
    inputs = moe_inputs(SMALL_K1.shape, "float32", np.random.default_rng(11), id_low=-1, id_high=7)
    out = run(
        inputs,
        jit=False,
        experts="xla",
        chunk_size=2,
        expert_map=jnp.asarray(expert_map),
        apply_router_weight_on_input=True,
    )
    ref = inputs.expected(expert_map=expert_map, apply_router_weight_on_input=True)
    assert_moe_close(out, ref, "float32")


@pytest.mark.parametrize("experts", ["xla", "xla_masked"])
def test_gelu_activation(experts):
    inputs = moe_inputs(
        SMALL.shape, "float32", np.random.default_rng(oracles.seed("gelu", experts))
    )
    out = run(inputs, jit=True, experts=experts, activation="gelu")
    assert_moe_close(out, inputs.expected(activation="gelu"), "float32")


def test_modular_moe_matches_fused_moe_with_an_experts_object():
    """`ModularMoE` assembled by hand equals the front door with the same experts object."""
    inputs = moe_inputs(SMALL.shape, "float32", np.random.default_rng(5), id_low=-1, id_high=5)
    layer = ModularMoE(
        NoEPPrepareFinalize(), ContiguousExperts(gemm="xla", permute_impl="xla"), chunk_size=3
    )
    out = layer(
        *(
            jnp.asarray(a)
            for a in (inputs.x, inputs.w1, inputs.w2, inputs.topk_weights, inputs.topk_ids)
        )
    )
    assert_moe_close(out, inputs.expected(), "float32")


def test_masked_experts_with_small_max_m_drop_overflow():
    """MaskedExperts(max_m) keeps the first max_m tokens per expert in token order; a token that
    repeats an expert takes one row there, and its slots share it."""
    from moe_jax import MaskedExperts

    problem = Problem("T6_H32_I16_E2_k2", 6, 32, 16, 2, 2)
    inputs = moe_inputs(problem.shape, "float32", np.random.default_rng(8))
    inputs.topk_ids[:] = [[0, 1], [0, 0], [1, 1], [0, 1], [1, 0], [0, 0]]
    out = run(inputs, jit=True, experts=MaskedExperts(gemm="xla", max_m=4))
    with pytest.raises(ValueError, match="exceeds the per-expert capacity of 6 rows"):
        run(inputs, jit=True, experts=MaskedExperts(gemm="xla", max_m=7))
    # Expert 0 holds tokens 0, 1 (both slots), 3, 4 and drops token 5 (both slots);
    # expert 1 holds tokens 0, 2 (both slots), 3, 4.
    kept = inputs.topk_ids.copy()
    kept[5:] = -1
    assert_moe_close(out, dataclasses.replace(inputs, topk_ids=kept).expected(), "float32")


# The masked layout's capacity (MaskedExperts docstring): E * max_m * row_bytes may not exceed
# weight_bytes + contiguous_rows * row_bytes. A float32 shape whose numbers are worked by hand:
# row_bytes = 4 * (H + 2I + I + H) = 448; weight_bytes = 4 * E * (2I * H + H * I) = 24576;
# contiguous_rows = round_up(T*k + min(T*k, E) * 127, 128) = round_up(800 + 508, 128) = 1408;
# capacity = (24576 + 1408 * 448) // (4 * 448) = 655360 // 1792 = 365 rows, below T = 400.
CAPACITY_PROBLEM = Problem("T400_H32_I16_E4_k2", 400, 32, 16, 4, 2)
CAPACITY = 365


def _capacity_inputs():
    """CAPACITY_PROBLEM's inputs with duplicate experts in a row and ids outside [0, E)."""
    rng = np.random.default_rng(oracles.seed("capacity"))
    inputs = moe_inputs(CAPACITY_PROBLEM.shape, "float32", rng, id_low=-1, id_high=5)
    inputs.topk_ids[:3] = [[2, 2], [-1, 4], [0, 0]]
    return inputs


def test_masked_capacity_is_bounded_by_the_problem():
    """The hand-worked bound above; at the capacity the layer matches the oracle (nothing drops:
    about 130 valid pairs per expert), and max_m=None (T = 400) refuses."""
    from moe_jax.experts import ExpertsProblem
    from moe_jax.masked_experts import MaskedExperts, masked_bound_rows

    problem = ExpertsProblem(
        num_tokens=400,
        topk=2,
        num_experts=4,
        hidden=32,
        intermediate=16,
        x_dtype="float32",
        mid_dtype="float32",
        group_size=None,
        weight_bytes=24576,
    )
    assert problem.row_bytes == 448
    assert masked_bound_rows(problem) == CAPACITY
    assert MaskedExperts(max_m=CAPACITY).capacity(problem) == CAPACITY
    assert MaskedExperts(max_m=CAPACITY).unsupported_reason(problem) is None
    assert "capacity of 365 rows" in MaskedExperts().unsupported_reason(problem)
    inputs = _capacity_inputs()
    out = run(inputs, jit=True, experts=MaskedExperts(gemm="xla", max_m=CAPACITY))
    assert_moe_close(out, inputs.expected(), "float32")


def test_masked_capacity_error_names_the_argument_and_capacity():
    """max_m=None (T = 400 rows per expert) and max_m = capacity + 1 both refuse before anything
    is compiled: a ValueError that is also the registry's NoImplementationError (with the
    refusal under the experts' name), naming max_m, the capacity, the rows and the pairs."""
    from moe_jax import MaskedExperts
    from moe_jax.masked_experts import MaskedCapacityError
    from moe_jax.registry import NoImplementationError

    inputs = _capacity_inputs()
    args = [jnp.asarray(a) for a in (inputs.x, inputs.w1, inputs.w2)]
    args += [jnp.asarray(inputs.topk_weights), jnp.asarray(inputs.topk_ids)]
    for max_m, rows in ((None, 1600), (CAPACITY + 1, 1464)):
        experts = MaskedExperts(gemm="xla", max_m=max_m)
        with pytest.raises(ValueError) as info:
            jax.eval_shape(functools.partial(fused_moe, experts=experts), *args)
        error = info.value
        assert isinstance(error, MaskedCapacityError)
        assert isinstance(error, NoImplementationError)
        why = error.refusals["xla_masked"]
        assert f"MaskedExperts(max_m={max_m}) exceeds the per-expert capacity of 365 rows" in why
        assert f"x E=4 = {rows} rows of 448 bytes" in why
        assert "for 800 routed (token, slot) pairs" in why
        assert "ContiguousExperts" in why and "max_m=m) with m <= 365" in why
        assert "num_dropped" in why
        assert ("chunk_size" in why) == (max_m is None)


def test_masked_capacity_follows_the_chunk():
    """Under chunking the experts see one chunk: max_m = chunk_size tokens fits again."""
    from moe_jax import MaskedExperts

    inputs = _capacity_inputs()
    out = run(inputs, jit=True, experts=MaskedExperts(gemm="xla"), chunk_size=200)
    assert_moe_close(out, inputs.expected(), "float32")


def _deepseek_v3_args(num_tokens: int):
    """ShapeDtypeStructs of DeepSeek-V3's experts on one GPU: nothing is allocated."""
    e, h, i, k = 256, 7168, 2048, 8
    fp8, f32 = jnp.float8_e4m3fn, jnp.float32
    shapes = [
        ((num_tokens, h), jnp.bfloat16),
        ((e, 2 * i, h), fp8),
        ((e, h, i), fp8),
        ((num_tokens, k), f32),
        ((num_tokens, k), jnp.int32),
        ((e, 2 * i // 128, h // 128), f32),
        ((e, h // 128, i // 128), f32),
    ]
    return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]


def _trace(experts, num_tokens: int, **kwargs):
    def layer(x, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale):
        return fused_moe(
            x,
            w1,
            w2,
            topk_weights,
            topk_ids,
            w1_scale=w1_scale,
            w2_scale=w2_scale,
            experts=experts,
            **kwargs,
        )

    return jax.eval_shape(layer, *_deepseek_v3_args(num_tokens))


def test_masked_capacity_on_deepseek_v3_shapes():
    """E=256 H=7168 I=2048 k=8 FP8 (the H200 decode table): T=512 traces on the masked layout,
    T=2048 (524288 rows for 16384 pairs) refuses whatever the GEMM, before the GEMM is chosen;
    chunks of the suggested size trace; "auto" runs where the masked layout refuses."""
    from moe_jax.experts_by_name import resolve_experts
    from moe_jax.masked_experts import MaskedCapacityError, masked_max_tokens

    assert _trace("xla_masked", 512).shape == (512, 7168)
    for experts in ("xla_masked", "deep_gemm_masked"):
        with pytest.raises(MaskedCapacityError, match="capacity of 1566 rows") as info:
            _trace(experts, 2048)
    why = info.value.refusals["deep_gemm_masked"]
    assert "524288 rows of 32032 bytes" in why and "16384 routed" in why
    problem = info.value.problem
    assert masked_max_tokens(problem) == 1550
    assert _trace("xla_masked", 2048, chunk_size=1550).shape == (2048, 7168)
    assert resolve_experts("auto").unsupported_reason(problem) is None
    assert _trace("auto", 2048).shape == (2048, 7168)


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["auto", "deep_gemm", "deep_gemm_masked", "pallas"])
@pytest.mark.parametrize("num_tokens", [1, 8, 33])
def test_decode_size_gpu_experts_match_oracle(experts, num_tokens):
    """Few tokens per expert on the GPU backends (masked blocks shorter than 128 rows included),
    held to the FP8 GPU bound: relative Frobenius error 2e-2 against the float64 oracle."""
    problem = Problem(f"T{num_tokens}_H512_I256_E16_k4", num_tokens, 512, 256, 16, 4)
    inputs = moe_inputs(problem.shape, "fp8", np.random.default_rng(40 + num_tokens))
    out = np.asarray(run(inputs, jit=True, experts=experts)).astype(np.float64)
    ref = inputs.expected()
    assert np.linalg.norm(out - ref) <= 2e-2 * np.linalg.norm(ref)


@pytest.mark.gpu
@pytest.mark.default_matmul_precision
def test_float32_follows_default_matmul_precision_on_gpu():
    """float32 layers run in TF32 by default on the GPU (about 5e-4 relative error, documented
    in the README) and in full float32 under jax.default_matmul_precision("highest")."""
    problem = Problem("T64_H256_I128_E8_k2", 64, 256, 128, 8, 2)
    inputs = moe_inputs(problem.shape, "float32", np.random.default_rng(77))
    ref = inputs.expected()

    def rel_error(out):
        return np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)

    default = rel_error(run(inputs, jit=True, experts="xla"))
    with jax.default_matmul_precision("highest"):
        highest = rel_error(run(inputs, jit=True, experts="xla"))
    assert highest < 1e-5 < 1e-4 < default < 5e-3, (default, highest)


# --- bad input ---------------------------------------------------------------------------------


def _good(dtype="float32"):
    problem = FP8_PROBLEMS[0] if dtype == "fp8" else Problem("T3_H32_I16_E4_k2", 3, 32, 16, 4, 2)
    inputs = moe_inputs(problem.shape, dtype, np.random.default_rng(0))
    return {
        "hidden_states": jnp.asarray(inputs.x),
        "w1": jnp.asarray(inputs.w1),
        "w2": jnp.asarray(inputs.w2),
        "topk_weights": jnp.asarray(inputs.topk_weights),
        "topk_ids": jnp.asarray(inputs.topk_ids),
        "w1_scale": None if inputs.w1_scale is None else jnp.asarray(inputs.w1_scale),
        "w2_scale": None if inputs.w2_scale is None else jnp.asarray(inputs.w2_scale),
    }


POSITIONAL = ("hidden_states", "w1", "w2", "topk_weights", "topk_ids")


def _call(args: dict, **kwargs):
    args = {"experts": "xla", **args, **kwargs}
    return fused_moe(
        args.pop("hidden_states"),
        args.pop("w1"),
        args.pop("w2"),
        args.pop("topk_weights"),
        args.pop("topk_ids"),
        **args,
    )


# (id, change to the good inputs, error, message); an unknown experts name's list of valid
# names: the test below
BAD_INPUTS = [
    ("x_3d", dict(hidden_states=jnp.ones((3, 32, 1))), ValueError, r"hidden_states\.shape"),
    ("x_int", dict(hidden_states=jnp.ones((3, 32), jnp.int32)), TypeError, r"hidden_states\.dtype"),
    (
        "x_width",
        dict(hidden_states=jnp.ones((3, 64))),
        ValueError,
        r"hidden_states\.shape=\(3, 64\) but the weights have H=32",
    ),
    ("w1_e_i_h", dict(w1=jnp.ones((4, 16, 32))), ValueError, r"w1\.shape=\(4, 16, 32\)"),
    ("float_scales", dict(w1_scale=jnp.ones((4, 1, 1))), ValueError, r"w1_scale was given"),
    (
        "map_short",
        dict(expert_map=jnp.zeros((2,), jnp.int32)),
        ValueError,
        r"expert_map\.shape=\(2,\) maps fewer",
    ),
    ("chunk_float", dict(chunk_size=4.5), ValueError, r"chunk_size=4\.5"),
    ("chunk_zero", dict(chunk_size=0), ValueError, r"chunk_size=0"),
    (
        "w2_inter",
        dict(w2=jnp.ones((4, 32, 8))),
        ValueError,
        r"w2\.shape=\(4, 32, 8\) but \[E, H, I\] = \(4, 32, 16\)",
    ),
    ("w2_experts", dict(w2=jnp.ones((3, 32, 16))), ValueError, r"w2\.shape"),
    ("w1_odd_2i", dict(w1=jnp.ones((4, 31, 32))), ValueError, r"w1\.shape"),
    ("w_dtypes_differ", dict(w2=jnp.ones((4, 32, 16), jnp.bfloat16)), TypeError, r"w1\.dtype"),
    ("ids_rows", dict(topk_ids=jnp.zeros((4, 2), jnp.int32)), ValueError, r"topk_ids\.shape"),
    ("ids_float", dict(topk_ids=jnp.zeros((3, 2), jnp.float32)), TypeError, r"topk_ids\.dtype"),
    ("weights_shape", dict(topk_weights=jnp.ones((3, 3))), ValueError, r"topk_weights\.shape"),
    (
        "weights_int",
        dict(topk_weights=jnp.ones((3, 2), jnp.int32)),
        TypeError,
        r"topk_weights\.dtype",
    ),
    (
        "on_input_k2",
        dict(apply_router_weight_on_input=True),
        ValueError,
        r"apply_router_weight_on_input",
    ),
    (
        "map_vs_global",
        dict(expert_map=jnp.zeros((6,), jnp.int32), global_num_experts=8),
        ValueError,
        r"global_num_experts",
    ),
    ("global_without_map", dict(global_num_experts=1), ValueError, r"global_num_experts=1"),
    ("global_float", dict(global_num_experts=4.0), TypeError, r"global_num_experts=4.0"),
    ("map_float", dict(expert_map=jnp.zeros((6,), jnp.float32)), ValueError, r"expert_map"),
    ("activation", dict(activation="relu"), ValueError, r"unknown activation 'relu'.*gelu.*silu"),
    ("experts_name", dict(experts="cutlass"), ValueError, r"unknown experts 'cutlass'"),
]


def _params(cases) -> list:
    return [pytest.param(*case[1:], id=case[0]) for case in cases]


@pytest.mark.parametrize(("change", "error", "match"), _params(BAD_INPUTS))
def test_bad_input_raises_naming_the_argument(change, error, match):
    with pytest.raises(error, match=match):
        _call(_good(), **change)


def test_an_unknown_experts_name_offers_the_closest_and_the_base_names():
    """The message names the closest valid names, the base names and `experts_names()`, which
    lists every name a user may pass (tests/test_plan.py: without the tests' interpret twins)."""
    with pytest.raises(ValueError, match=r"unknown experts 'deepgemm'; did you mean 'deep_gemm'"):
        _call(_good(), experts="deepgemm")
    with pytest.raises(ValueError, match=r"unknown experts 'cutlass'") as raised:
        _call(_good(), experts="cutlass")
    message = str(raised.value)
    assert "did you mean" not in message and "moe_jax.experts_names()" in message
    for name in ("auto", "deep_gemm", "pallas", "torch", "xla"):
        assert repr(name) in message
    assert "deep_gemm_masked" in experts_names() and "xla+mosaic_fp8_gathered" in experts_names()


@pytest.mark.parametrize(
    ("change", "error", "match"),
    _params(p for p in BAD_INPUTS if set(p[1]) <= set(inspect.signature(moe_reference).parameters)),
)
def test_the_reference_checks_its_inputs_as_fused_moe_does(change, error, match):
    """`moe_reference` takes `fused_moe`'s arguments and refuses the same bad ones (before, a
    [T, 2] weights array with [T, 1] ids was broadcast silently)."""
    args = {**_good(), **change}
    positional = [args.pop(k) for k in POSITIONAL]
    with pytest.raises(error, match=match):
        moe_reference(*positional, **args)


def test_contiguous_experts_take_the_permute_by_name():
    """One name picks both the permute and its weighted gather; an implementation object would
    be one of the two, so it is refused at construction."""
    from moe_jax import permute

    with pytest.raises(TypeError, match=r"permute_impl=.*pass a name"):
        ContiguousExperts(permute_impl=permute.PERMUTES.get("xla"))


def test_numpy_inputs_equal_jax_inputs():
    """NumPy arrays are accepted everywhere (weights included) and give the same result."""
    good = _good()
    as_numpy = {k: None if v is None else np.asarray(v) for k, v in good.items()}
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda: _call(as_numpy))()), np.asarray(_call(good))
    )


@pytest.mark.parametrize("hidden,inter", [(64, 128), (128, 64), (192, 128)])
def test_fp8_needs_h_and_i_multiples_of_128(hidden, inter):
    rng = np.random.default_rng(hidden + inter)
    w1, s1 = oracles.per_block_quant_fp8(rng.standard_normal((2, 2 * inter, hidden)))
    w2, s2 = oracles.per_block_quant_fp8(rng.standard_normal((2, hidden, inter)))
    with pytest.raises(ValueError, match=r"multiples of 128.*H=.*I="):
        fused_moe(
            jnp.ones((3, hidden), jnp.bfloat16),
            jnp.asarray(w1),
            jnp.asarray(w2),
            jnp.ones((3, 1)),
            jnp.zeros((3, 1), jnp.int32),
            w1_scale=jnp.asarray(s1),
            w2_scale=jnp.asarray(s2),
            experts="xla",
        )


def test_fp8_scales_missing_or_misshaped():
    args = _good("fp8")
    with pytest.raises(ValueError, match=r"w1_scale"):
        _call(args, w1_scale=None)
    with pytest.raises(ValueError, match=r"w2_scale"):
        _call(args, w2_scale=jnp.ones((4, 2, 1), jnp.float32))
    with pytest.raises(ValueError, match=r"w1_scale"):
        _call(args, w1_scale=args["w1_scale"].astype(jnp.bfloat16))


# --- under jax.jit: which arguments are static -------------------------------------------------

STATIC_ARGNAMES = (
    "activation",
    "apply_router_weight_on_input",
    "global_num_experts",
    "chunk_size",
    "experts",
    "block_shape",
)


def _positional(args: dict) -> list:
    return [args[k] for k in POSITIONAL]


@pytest.mark.parametrize(
    "name,value",
    [
        ("chunk_size", 2),
        ("global_num_experts", 4),
        ("apply_router_weight_on_input", 0),
        ("block_shape", [128, 128]),  # a list is a pytree: its ints are traced
    ],
)
def test_a_traced_static_argument_is_refused_naming_it_and_the_static_argnames(name, value):
    """jax.jit traces Python ints and bools too: the error says which argument and how to mark
    it static (it used to be "chunk_size=JitTracer(~int32[]) must be a positive int")."""
    args = _good()
    with pytest.raises(TypeError, match=rf"fused_moe: {name} arrived traced") as raised:
        jax.jit(fused_moe)(*_positional(args), **{name: value})
    assert f"jax.jit(fused_moe, static_argnames={STATIC_ARGNAMES})" in str(raised.value)


@pytest.mark.parametrize("name,value", [("experts", "xla"), ("activation", "silu")])
def test_a_string_argument_under_jit_is_refused_by_jax_naming_it(name, value):
    """A string never reaches fused_moe under jax.jit: JAX refuses it first, naming the argument
    and static_argnames (this test holds that message as fused_moe's docstring relies on it)."""
    with pytest.raises(TypeError, match=rf"(?s)path {name}\b.*static_argnames"):
        jax.jit(fused_moe)(*_positional(_good()), **{name: value})


def test_the_documented_static_argnames_run_under_jit():
    """The docstring's tuple is the one the error gives, and jit with it runs every static
    argument (block_shape as a tuple: static arguments are hashed)."""
    doc = " ".join(fused_moe.__doc__.split())
    listed = "(" + ", ".join(f'"{n}"' for n in STATIC_ARGNAMES) + ")"
    assert f"jax.jit(fused_moe, static_argnames={listed})" in doc
    args = _good("fp8")
    static = dict(
        activation="gelu",
        apply_router_weight_on_input=False,
        global_num_experts=args["w1"].shape[0],
        chunk_size=2,
        experts="xla",
        block_shape=(128, 128),
    )
    assert set(static) == set(STATIC_ARGNAMES)
    scales = dict(w1_scale=args["w1_scale"], w2_scale=args["w2_scale"])
    jitted = jax.jit(fused_moe, static_argnames=STATIC_ARGNAMES)
    np.testing.assert_array_equal(
        np.asarray(jitted(*_positional(args), **scales, **static), np.float32),
        np.asarray(fused_moe(*_positional(args), **scales, **static), np.float32),
    )


# --- block_shape, as vLLM's fused_experts takes it -----------------------------------------------


def test_block_shape_128_is_accepted_as_vllm_passes_it():
    args = _good("fp8")
    np.testing.assert_array_equal(
        np.asarray(_call(args, block_shape=[128, 128]), np.float32),
        np.asarray(_call(args), np.float32),
    )


@pytest.mark.parametrize(
    ("dtype", "change", "match"),
    _params(
        [
            (
                "64x64",
                "fp8",
                dict(block_shape=[64, 64]),
                r"block_shape=\[64, 64\]: only \[128, 128\]",
            ),
            ("int", "fp8", dict(block_shape=128), r"block_shape=128: only \[128, 128\]"),
            ("three", "fp8", dict(block_shape=[128, 128, 1]), r"only \[128, 128\]"),
            (
                "float_weights",
                "float32",
                dict(block_shape=[128, 128]),
                r"describes FP8 .* w1\.dtype=float32",
            ),
            ("no_scales", "fp8", dict(block_shape=[128, 128], w1_scale=None), r"w1_scale is None"),
            (  # scales made for 64x64 tiles
                "scales_of_another_tile",
                "fp8",
                dict(block_shape=(128, 128), w2_scale=jnp.ones((4, 2, 2), jnp.float32)),
                r"w2_scale is float32\[4, 2, 2\] but float32\[4, 1, 1\] .*one scale per 128x128",
            ),
        ]
    ),
)
def test_block_shape_is_checked_against_the_weights_and_scales(dtype, change, match):
    with pytest.raises(ValueError, match=match):
        _call(_good(dtype), **change)
