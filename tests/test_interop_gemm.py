"""Grouped-GEMM backends "torch" and "deep_gemm" against a float64 numpy oracle.

CPU: the torch backend end to end through the bridge, DeepGEMM's pure-JAX parts (scale layout,
checks, refusals). GPU (`-m gpu`): DeepGEMM through the bridge bitwise equal to the direct torch
call of DeepGEMM, both within FP8 tolerance of the oracle, and the scale view costing no transpose.
Tests that need torch (or DeepGEMM) skip with the reason when it is not installed.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest
from gemm_problems import RoutedProblem

from moe_jax import grouped_gemm, layouts, quant
from moe_jax.grouped_gemm import GEMMS

GPU_PROBLEMS = [
    RoutedProblem("gpu_small", 200, 4, 8, 256, 512, 128),
    RoutedProblem("gpu_wide", 96, 2, 4, 512, 1024, 128),
]
TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float8_e4m3fn": 1e-5}


def _operands(problem, dtype, seed=0):
    """(x_rows, x_scales, w, w_scales, float64 x, float64 w) in `dtype`, fresh random data."""
    kx, kw, kr = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (problem.num_tokens, problem.k))
    w = jax.random.normal(kw, (problem.num_experts, problem.n, problem.k)) * 0.1
    ids = jax.random.randint(kr, (problem.num_tokens, problem.topk), -1, problem.num_experts + 1)
    if dtype == "float8_e4m3fn":
        xq, xs = quant.per_token_group_quant_fp8(x)
        wq, ws = quant.per_block_quant_fp8(w)
        xf = oracles.dequant_per_token_group(xq.astype(jnp.float32), xs)
        wf = oracles.dequant_per_block(wq.astype(jnp.float32), ws)
        return xq, xs, wq, ws, ids, xf, wf
    x, w = x.astype(dtype), w.astype(dtype)
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    wf = np.asarray(w.astype(jnp.float32), np.float64)
    return x, None, w, None, ids, xf, wf


def _rel_err(y, ref):
    return np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30)


def _run_contiguous(backend, problem, dtype, out_dtype, seed=0):
    x, xs, w, ws, ids, xf, wf = _operands(problem, dtype, seed)
    lay = _permute(
        x, ids, num_experts=problem.num_experts, x_scales=xs, alignment=problem.alignment
    )
    f = jax.jit(
        lambda *a, **kw: backend.contiguous(
            *a, **kw, alignment=problem.alignment, out_dtype=out_dtype
        )
    )
    y = f(lay.rows, w, lay.expert_ids, lay.expert_ends, x_scales=lay.row_scales, w_scales=ws)
    # The oracle reads rows from the float64 inputs by the same (source token) routing.
    rows = np.zeros((lay.rows.shape[0], problem.k))
    inverse = np.asarray(lay.inverse)
    for t in range(problem.num_tokens):
        for j in range(problem.topk):
            if inverse[t, j] >= 0:
                rows[inverse[t, j]] = xf[t]
    ref = oracles.grouped_gemm_contiguous(rows, wf, lay.expert_ids)
    return y, ref, lay


_permute = layouts.permute_reference
_masked_layout = layouts.masked_layout_reference


def _problem_for(backend_layout, problem, dtype, *, max_m=None):
    return grouped_gemm.GemmProblem(
        layout=backend_layout,
        n=problem.n,
        k=problem.k,
        num_experts=problem.num_experts,
        num_pairs=problem.num_tokens * problem.topk,
        x_dtype=dtype,
        w_dtype=dtype,
        platform=jax.default_backend(),
        alignment=problem.alignment if backend_layout == "contiguous" else None,
        max_m=max_m,
    )


# ---------------------------------------------------------------- torch backend: refusals
# (its results against the float64 loops, both layouts, every dtype, no rows, forward and VJP,
# are tests/test_contract_grouped_gemm.py's, as every GEMMS name's)

GPU_F32 = grouped_gemm.GemmProblem(
    layout="masked",
    n=16,
    k=128,
    num_experts=2,
    num_pairs=8,
    x_dtype="float32",
    w_dtype="float32",
    platform="gpu",
    max_m=8,
)


def _pretend_missing(monkeypatch, *missing: str, present: tuple[str, ...] = ()):
    """importlib.util.find_spec answers None for `missing` and a stand-in for `present`."""
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name in missing:
            return None
        if name in present:
            return object()
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_torch_refusals(monkeypatch):
    backend = GEMMS.get("torch")
    _pretend_missing(monkeypatch, present=("torch",))  # the rules below the install check
    assert "float32" in backend.unsupported_reason(GPU_F32)  # partial 16-byte rows: below
    tpu = dataclasses.replace(GPU_F32, platform="tpu")
    assert "tpu" in backend.unsupported_reason(tpu)


def test_torch_refusal_without_torch_names_the_extra(monkeypatch):
    backend = GEMMS.get("torch")
    _pretend_missing(monkeypatch, "torch")
    cpu = dataclasses.replace(GPU_F32, platform="cpu")
    assert "pip install 'moe_jax[torch]'" in backend.unsupported_reason(cpu)
    with pytest.raises(NotImplementedError, match=r"moe_jax\[torch\]"):
        GEMMS.select("torch", cpu)


# ---------------------------------------------------------------- deep_gemm: pure-JAX parts (CPU)


def test_scale_layout_round_trips_through_the_torch_view():
    torch = pytest.importorskip("torch", reason="the torch view of the scales needs torch")
    from moe_jax.interop import deep_gemm

    for shape in [(6, 2), (8, 3), (1, 1), (4, 5, 2)]:
        s = jax.random.uniform(jax.random.key(len(shape)), shape)
        sfa_t = deep_gemm.mn_major_scales(s)
        m = shape[-2]
        padded = -(-m // 4) * 4
        assert sfa_t.shape == (*shape[:-2], shape[-1], padded)
        assert np.all(np.asarray(sfa_t)[..., m:] == 0)
        view = deep_gemm.tma_aligned_view(torch.from_dlpack(sfa_t), m)
        np.testing.assert_array_equal(view.cpu().numpy(), np.asarray(s))
        # DeepGEMM's "already MN-major and TMA-aligned" condition (get_mn_major_tma_aligned_tensor)
        assert view.stride()[-2:] == (1, padded)
        if len(shape) == 3:
            assert view.stride(0) == padded * shape[-1]


def test_deep_gemm_refuses_off_gpu_and_explains(monkeypatch, request):
    backend = GEMMS.get("deep_gemm")
    problem = grouped_gemm.GemmProblem(
        layout="contiguous",
        n=256,
        k=256,
        num_experts=4,
        num_pairs=256,
        x_dtype="float8_e4m3fn",
        w_dtype="float8_e4m3fn",
        platform="cpu",
        alignment=128,
    )
    assert "GPU" in backend.unsupported_reason(problem)
    with pytest.raises(NotImplementedError, match="deep_gemm"):
        GEMMS.select("deep_gemm", problem)
    # On a GPU without the library (pretended, so this runs with or without torch installed).
    # The backend caches its import attempt: forget it before and after.
    from moe_jax.interop import deep_gemm

    request.addfinalizer(deep_gemm._library.cache_clear)
    gpu = dataclasses.replace(problem, platform="gpu")
    _pretend_missing(monkeypatch, "deep_gemm", present=("torch",))
    deep_gemm._library.cache_clear()
    why = backend.unsupported_reason(gpu)
    assert "deepinfer-gemm" in why and "nvcc" in why
    _pretend_missing(monkeypatch, "torch")
    deep_gemm._library.cache_clear()
    assert "moe_jax[torch]" in backend.unsupported_reason(gpu)


def test_deep_gemm_checks_operands_before_calling_the_library():
    from moe_jax.interop import deep_gemm

    backend = deep_gemm.DeepGemm()
    wq, ws = quant.per_block_quant_fp8(jnp.ones((2, 256, 256)))
    xq = jnp.zeros((128, 256), quant.FP8_DTYPE)
    ids = jnp.zeros((128,), jnp.int32)
    ends = jnp.array([128, 128], jnp.int32)
    kw = dict(alignment=128, out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="w_scales"):
        backend.contiguous(xq, wq, ids, ends, x_scales=jnp.ones((128, 2)), **kw)
    with pytest.raises(ValueError, match="x_scales"):
        backend.contiguous(xq, wq, ids, ends, w_scales=ws, **kw)
    with pytest.raises(ValueError, match="multiples of 128"):
        backend.contiguous(
            jnp.zeros((128, 200), jnp.bfloat16),
            jnp.ones((2, 256, 200), jnp.bfloat16),
            ids,
            ends,
            **kw,
        )
    with pytest.raises(ValueError, match="aligned"):
        backend.contiguous(
            xq[:100], wq, ids[:100], ends, x_scales=jnp.ones((100, 2)), w_scales=ws, **kw
        )
    with pytest.raises(TypeError, match="bfloat16"):
        backend.masked(
            jnp.zeros((2, 4, 256)),
            jnp.ones((2, 256, 256), jnp.bfloat16),
            jnp.zeros((2,), jnp.int32),
            out_dtype=jnp.bfloat16,
        )
    # Nothing routed: zeros, and DeepGEMM (absent on CPU) is never resolved.
    y = backend.contiguous(xq[:0], wq, ids[:0], ends, x_scales=jnp.ones((0, 2)), w_scales=ws, **kw)
    assert y.shape == (0, 256)


# ---------------------------------------------------------------- deep_gemm on the GPU

FP8_TOL = 1e-2  # bf16 output rounding on identical quantized inputs (FP8 error is in the inputs)


def _torch_view(a):
    import torch

    return torch.from_dlpack(a)


@pytest.mark.gpu
@pytest.mark.parametrize("problem", GPU_PROBLEMS, ids=str)
def test_deep_gemm_contiguous_bitwise_equals_direct_call(problem):
    import deep_gemm as dg
    import torch

    backend = GEMMS.get("deep_gemm")
    num_rows = layouts.contiguous_num_rows(
        problem.num_tokens, problem.topk, problem.num_experts, problem.alignment
    )
    assert backend.unsupported_reason(_problem_for("contiguous", problem, "float8_e4m3fn")) is None
    y, ref, lay = _run_contiguous(backend, problem, "float8_e4m3fn", jnp.bfloat16, seed=11)
    x, xs, w, ws, ids, _, _ = _operands(problem, "float8_e4m3fn", seed=11)
    lay = _permute(x, ids, num_experts=problem.num_experts, x_scales=xs, alignment=128)
    jax.block_until_ready(lay)
    d = torch.empty((num_rows, problem.n), dtype=torch.bfloat16, device="cuda")
    dg.m_grouped_fp8_gemm_nt_contiguous(
        (_torch_view(lay.rows), _torch_view(lay.row_scales).contiguous()),
        (_torch_view(w), _torch_view(ws)),
        d,
        _torch_view(lay.expert_ids),
    )
    torch.cuda.synchronize()
    is_valid = np.asarray(lay.expert_ids) >= 0
    direct = d.float().cpu().numpy()
    got = np.asarray(y.astype(jnp.float32))
    np.testing.assert_array_equal(got[is_valid], direct[is_valid])
    assert _rel_err(got[is_valid].astype(np.float64), ref[is_valid]) < FP8_TOL


@pytest.mark.gpu
def test_deep_gemm_masked_bitwise_equals_direct_call():
    import deep_gemm as dg
    import torch

    problem = RoutedProblem("gpu_masked", 300, 4, 4, 256, 512, 1)
    max_m = 256
    backend = GEMMS.get("deep_gemm")
    x, xs, w, ws, ids, xf, wf = _operands(problem, "float8_e4m3fn", seed=13)
    lay = _masked_layout(x, ids, num_experts=4, max_m=max_m, x_scales=xs)
    f = jax.jit(lambda *a, **kw: backend.masked(*a, **kw, expected_m=128, out_dtype=jnp.bfloat16))
    y = f(lay.rows, w, lay.num_tokens_per_expert, x_scales=lay.row_scales, w_scales=ws)
    d = torch.empty((4, max_m, problem.n), dtype=torch.bfloat16, device="cuda")
    dg.m_grouped_fp8_gemm_nt_masked(
        (_torch_view(lay.rows), _torch_view(lay.row_scales).contiguous()),
        (_torch_view(w), _torch_view(ws)),
        d,
        _torch_view(lay.num_tokens_per_expert),
        128,
    )
    torch.cuda.synchronize()
    counts = np.asarray(lay.num_tokens_per_expert)
    is_valid = np.arange(max_m)[None, :] < counts[:, None]
    got = np.asarray(y.astype(jnp.float32))
    np.testing.assert_array_equal(got[is_valid], d.float().cpu().numpy()[is_valid])
    rows_f = np.zeros((4 * max_m, problem.k))
    inverse = np.asarray(lay.inverse)
    for t, j in np.ndindex(inverse.shape):
        if inverse[t, j] >= 0:
            rows_f[inverse[t, j]] = xf[t]
    ref = oracles.grouped_gemm_masked(rows_f.reshape(4, max_m, -1), wf, counts)
    assert _rel_err(got[is_valid].astype(np.float64), ref[is_valid]) < FP8_TOL


@pytest.mark.gpu
def test_deep_gemm_bf16_contiguous_matches_oracle():
    problem = RoutedProblem("gpu_bf16", 160, 2, 4, 256, 256, 128)
    y, ref, lay = _run_contiguous(
        GEMMS.get("deep_gemm"), problem, "bfloat16", jnp.bfloat16, seed=17
    )
    is_valid = np.asarray(lay.expert_ids) >= 0
    got = np.asarray(y.astype(jnp.float32), np.float64)[is_valid]
    assert _rel_err(got, ref[is_valid]) < TOL["bfloat16"]


@pytest.mark.gpu
def test_scale_view_needs_no_transpose_kernel():
    """DeepGEMM returns our view itself (same storage): it launches no layout kernel."""
    import deep_gemm as dg

    from moe_jax.interop import deep_gemm

    for shape in [(384, 4), (3, 256, 8), (130, 7)]:
        s = jax.random.uniform(jax.random.key(0), shape)
        view = deep_gemm.tma_aligned_view(_torch_view(deep_gemm.mn_major_scales(s)), shape[-2])
        same = dg.get_mn_major_tma_aligned_tensor(view)
        assert same.data_ptr() == view.data_ptr() and same.stride() == view.stride()
        np.testing.assert_array_equal(same.cpu().numpy(), np.asarray(s))


@pytest.mark.parametrize(
    "dtype, n, k, refused",
    [
        ("float32", 12, 6, True),  # GEMM2 of I=6: 24-byte rows
        ("bfloat16", 16, 12, True),
        ("float32", 12, 16, False),
        ("bfloat16", 16, 8, False),
    ],
)
def test_torch_backend_refuses_rows_of_partial_16_byte_units(monkeypatch, dtype, n, k, refused):
    """torch's grouped GEMM takes rows of whole 16-byte units on the CPU too: such a problem
    used to be accepted and fail inside the callback ("strides should be multiple of 16 bytes")."""
    from moe_jax.grouped_gemm import GEMMS, GemmProblem

    _pretend_missing(monkeypatch, present=("torch",))  # the rules below the install check
    problem = GemmProblem(
        layout="contiguous", n=n, k=k, num_experts=2, num_pairs=4, x_dtype=dtype, w_dtype=dtype
    )
    reason = GEMMS.get("torch").unsupported_reason(problem)
    assert (reason is not None) == refused, reason
    if refused:
        assert "16-byte" in reason
