"""The fast path end to end: Pallas quantize/permute/act-quant/gather around the grouped GEMMs.

On the CPU every kernel runs in interpret mode with the XLA GEMM, bitwise equal to the XLA
pipeline on FP8 (the kernels share the references' arithmetic; `test_kernels_act_quant.py` states
what interpret mode does not cover). On a GPU (`-m gpu`) `fused_moe(experts="auto")` takes the
real kernels and the best GEMM backend there.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles import assert_moe_close, moe_inputs
from test_fused_moe import Problem

from moe_jax import ContiguousExperts, ModularMoE, NoEPPrepareFinalize, fused_moe, layouts
from moe_jax.experts import ExpertWeights
from moe_jax.experts_by_name import resolve_experts
from moe_jax.grouped_gemm import XlaGemm

INTERPRET = ModularMoE(
    NoEPPrepareFinalize(quant_impl="pallas_interpret"),
    ContiguousExperts(
        gemm="xla", permute_impl="pallas_interpret", act_quant_impl="pallas_interpret"
    ),
)
CPU_PROBLEM = Problem("T9_H256_I128_E4_k3", 9, 256, 128, 4, 3)
GPU_PROBLEM = Problem("T300_H512_I256_E8_k4", 300, 512, 256, 8, 4)


def _call(layer, inputs, **kwargs):
    scales = inputs.scales()
    return np.asarray(jax.jit(lambda *a: layer(*a, **scales, **kwargs))(*inputs.args()))


@pytest.mark.parametrize("dtype", ["fp8", "bfloat16", "float32"])
def test_interpret_pipeline_matches_oracle(dtype):
    """On a GPU host the XLA GEMM runs there too: float32 dots in float32, not TF32."""
    # ids in [-1, E + 2) (E = 4): duplicates, negative and out-of-range ids, negative weights.
    inputs = moe_inputs(CPU_PROBLEM.shape, dtype, np.random.default_rng(11), id_low=-1, id_high=6)
    with jax.default_matmul_precision("highest"):
        out = _call(INTERPRET, inputs)
    assert_moe_close(out, inputs.expected(), dtype)


@pytest.mark.cpu_numerics
def test_interpret_pipeline_equals_xla_pipeline_bitwise_on_fp8():
    inputs = moe_inputs(CPU_PROBLEM.shape, "fp8", np.random.default_rng(12))
    xla = ModularMoE(
        NoEPPrepareFinalize(quant_impl="xla"),
        ContiguousExperts(gemm="xla", permute_impl="xla", act_quant_impl="xla"),
    )
    np.testing.assert_array_equal(_call(INTERPRET, inputs), _call(xla, inputs))


class _GroupMajorXlaGemm(XlaGemm):
    """The XLA GEMM, declaring that it reads FP8 activation scales group-major."""

    name = "xla_group_major"
    is_scales_group_major = True


def _pallas_calls(jaxpr) -> dict[str, list[tuple[int, ...]]]:
    """Output shapes of every pallas_call in a jaxpr (nested jaxprs included), by kernel name."""
    found: dict[str, list[tuple[int, ...]]] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            name = str(eqn.params.get("name_and_src_info", eqn.params.get("name")))
            found.setdefault(name.split("_")[0], []).extend(v.aval.shape for v in eqn.outvars)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    for name, shapes in _pallas_calls(inner).items():
                        found.setdefault(name, []).extend(shapes)
    return found


@pytest.mark.parametrize("gemm", [XlaGemm(), _GroupMajorXlaGemm()], ids=lambda g: g.name)
def test_scales_layout_follows_the_gemm_and_keeps_the_values(gemm):
    """A GEMM that reads scales group-major gets them written so by the permute and the act*up
    + quantize kernels ([G, M] outputs), and the layer's output keeps every bit."""
    inputs = moe_inputs(CPU_PROBLEM.shape, "fp8", np.random.default_rng(16))
    layer = ModularMoE(
        NoEPPrepareFinalize(quant_impl="pallas_interpret"),
        ContiguousExperts(
            gemm=gemm, permute_impl="pallas_interpret", act_quant_impl="pallas_interpret"
        ),
    )
    arrays, scales = inputs.args(), inputs.scales()
    calls = _pallas_calls(jax.make_jaxpr(lambda *a: layer(*a, **scales))(*arrays).jaxpr)
    p = CPU_PROBLEM
    rows = layouts.contiguous_num_rows(p.num_tokens, p.topk, p.num_experts, gemm.alignment)
    group_major = gemm.is_scales_group_major
    for kernel, groups in (("permute", p.hidden // 128), ("act", p.inter // 128)):
        want = (groups, rows) if group_major else (rows, groups)
        assert want in calls[kernel], (kernel, calls[kernel])
    np.testing.assert_array_equal(_call(layer, inputs), _call(INTERPRET, inputs))


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def assert_close_gpu(out, ref, dtype: str):
    """GPU GEMMs are not the oracle's float64 GEMM: DeepGEMM's FP8 tensor-core accumulation (and
    TF32 in XLA's float32 dots) flip bf16 intermediates and then FP8 codes far more often than on
    the CPU, each flip moving one output element by a few percent (H200, 2026-11-29: DeepGEMM
    rel. error 1.0e-2, calc_diff 5e-5, max |diff| 2.6% of max |ref| on this problem). So FP8 is
    held to whole-output bounds: vLLM's DeepGEMM test bound calc_diff < 1e-3, a relative
    Frobenius error < 2e-2, and no element off by more than 5% of the largest |ref|."""
    if dtype != "fp8":
        assert_moe_close(out, ref, dtype)
        return
    out = np.asarray(out).astype(np.float64)
    calc_diff = 1 - 2 * np.sum(out * ref) / np.sum(out * out + ref * ref)
    assert calc_diff < 1e-3, calc_diff
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-2
    assert np.max(np.abs(out - ref)) <= 0.05 * np.max(np.abs(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp8", "bfloat16"])
def test_auto_fast_path_on_gpu_matches_oracle(dtype):
    inputs = moe_inputs(GPU_PROBLEM.shape, dtype, np.random.default_rng(13), id_low=-1, id_high=9)
    weights = ExpertWeights(w1=jnp.asarray(inputs.w1), w2=jnp.asarray(inputs.w2))
    chosen = resolve_experts("auto")
    x_dtype = jnp.float8_e4m3fn if dtype == "fp8" else jnp.asarray(inputs.x).dtype
    gemm1 = chosen.plan_for(
        weights, num_tokens=GPU_PROBLEM.num_tokens, topk=GPU_PROBLEM.topk, x_dtype=x_dtype
    ).gemm1
    if _has("deep_gemm"):
        assert gemm1.name == "deep_gemm"
    assert gemm1.name != "xla", "a GPU with torch or Mosaic must not fall back to the XLA loop"
    out = _call(ModularMoE(NoEPPrepareFinalize(), chosen), inputs)
    assert_close_gpu(out, inputs.expected(), dtype)


def _scale_copies(hlo: str, num_groups: int, num_rows: int) -> list[str]:
    """Instructions of compiled HLO text that transpose, copy or pad a float32 [G, M] or
    [M, G] array (the layout's activation scales), fused computations included."""
    shapes = {f"f32[{num_groups},{num_rows}]", f"f32[{num_rows},{num_groups}]"}
    found = []
    for line in hlo.splitlines():
        if "=" not in line:
            continue
        result = line.split("=", 1)[1].strip()
        shape, _, rest = result.partition("{")
        opcode = rest.partition("} ")[2].split("(", 1)[0].strip()
        if shape in shapes and opcode in ("transpose", "copy", "pad"):
            found.append(line.strip())
    return found


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", ["pallas", "mosaic_fp8", "deep_gemm"])
def test_fp8_scales_reach_the_gemms_without_a_transpose(gemm):
    """The permute and act*up + quantize kernels write the scales group-major and every FP8
    GEMM reads them so: the compiled layer holds no transpose, copy or pad of them."""
    if gemm == "deep_gemm" and not _has("deep_gemm"):
        pytest.skip("deep_gemm is not installed")
    problem = Problem("T64_H512_I256_E4_k2", 64, 512, 256, 4, 2)
    inputs = moe_inputs(problem.shape, "fp8", np.random.default_rng(15))
    experts = ContiguousExperts(gemm=gemm)
    weights = ExpertWeights(w1=jnp.asarray(inputs.w1), w2=jnp.asarray(inputs.w2))
    alignment = experts.plan_for(
        weights, num_tokens=problem.num_tokens, topk=problem.topk, x_dtype=jnp.float8_e4m3fn
    ).alignment
    arrays, scales = inputs.args(), inputs.scales()
    layer = jax.jit(lambda *a: fused_moe(*a, **scales, experts=experts))
    hlo = layer.lower(*arrays).compile().as_text()
    num_rows = layouts.contiguous_num_rows(
        problem.num_tokens, problem.topk, problem.num_experts, alignment
    )
    for groups in (problem.hidden // 128, problem.inter // 128):
        assert _scale_copies(hlo, groups, num_rows) == [], (gemm, alignment)
    assert_close_gpu(np.asarray(layer(*arrays)), inputs.expected(), "fp8")


def test_scale_copies_finds_a_transpose():
    """The GPU test's HLO reader sees a transpose where one runs (so that test can fail)."""
    hlo = jax.jit(lambda s: s.T + 1).lower(jnp.ones((4, 256), jnp.float32)).compile().as_text()
    assert _scale_copies(hlo, 4, 256)
    hlo = jax.jit(lambda s: s + 1).lower(jnp.ones((4, 256), jnp.float32)).compile().as_text()
    assert _scale_copies(hlo, 4, 256) == []
