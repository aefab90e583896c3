"""The fused GEMM1 that gathers its rows from the tokens (`moe_jax.kernels.mosaic_fp8_gather`) and
the rowless layout it runs on (`moe_jax.permute.route`).

The kernel has no interpret mode (its copies are inline PTX): on the CPU its front runs the
reference (XLA gathers the rows, the contiguous fused kernel runs in interpret mode), which these
tests hold to a float64 loop on the oracle's permuted rows with `test_kernels_mosaic_fp8_gemm`'s
bounds; compiled (marked gpu), the kernel must equal that reference, compiled, bit for bit on
valid rows (the same wgmmas on the same bytes), and the layer with it the layer with the
contiguous fused GEMM1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest
from gemm_problems import DEEPSEEK_V3_FP8_GEMM1
from test_kernels_mosaic_fp8_gemm import (
    OVERLAPPED_PAIRS,
    PAIRS,
    PROBLEMS,
    _check_act_quant,
    _fp8_layer,
    _operands,
)

from moe_jax import layouts, permute
from moe_jax.contiguous_experts import ContiguousExperts
from moe_jax.experts import ExpertsCall, ExpertWeights
from moe_jax.fused_gemm1 import FUSED_GEMM1S, FusedGemm1Problem, fused_gemm1
from moe_jax.fused_moe import fused_moe
from moe_jax.kernels import mosaic_fp8_gather as gather
from moe_jax.kernels import mosaic_fp8_gemm as mg
from moe_jax.prepare_finalize import PreparedTokens
from moe_jax.quant import FP8_DTYPE, Fp8BlockQuant

pytestmark = pytest.mark.mosaic_interpret

IMPLS = [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="compiled", marks=pytest.mark.gpu),
]
ALIGNMENT = 128  # the gathered kernel's segments: whole pairs of 64-row blocks


# --- the rowless layout ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "topk", "num_experts", "with_map"),
    [(0, 2, 4, False), (1, 3, 4, False), (37, 4, 5, False), (37, 4, 3, True)],
    ids=["no_tokens", "one_token_duplicates", "ids_outside", "expert_map_holes"],
)
def test_route_matches_the_loops_and_the_permute(num_tokens, topk, num_experts, with_map):
    """Every field against `oracles.routing_metadata` (loops), and the same metadata as
    `permute.permute` with no rows: ids from -1 to E + 1, an expert twice in a row, and (with
    `expert_map`) global experts held elsewhere."""
    rng = np.random.default_rng(oracles.seed("route", num_tokens, with_map))
    global_experts = 2 * num_experts if with_map else num_experts
    ids = rng.integers(-1, global_experts + 2, (num_tokens, topk)).astype(np.int32)
    if num_tokens:
        ids[0, :2] = 1  # an expert twice in one row
    expert_map = None
    if with_map:  # every other global expert is held here
        expert_map = np.where(
            np.arange(global_experts) % 2 == 0, np.arange(global_experts) // 2, -1
        )
        expert_map = jnp.asarray(expert_map, jnp.int32)
    lay = permute.route(
        jnp.asarray(ids), num_experts=num_experts, expert_map=expert_map, alignment=ALIGNMENT
    )
    local = oracles.local_ids(
        ids, num_experts, None if expert_map is None else np.asarray(expert_map)
    )
    num_rows = oracles.contiguous_num_rows(num_tokens, topk, num_experts, ALIGNMENT)
    want = oracles.routing_metadata(local, num_experts, alignment=ALIGNMENT, num_rows=num_rows)
    assert lay.rows is None and lay.row_scales is None
    np.testing.assert_array_equal(lay.sources, want["source"])
    np.testing.assert_array_equal(lay.expert_ids, want["expert_ids"])
    np.testing.assert_array_equal(lay.inverse, want["inverse"])
    np.testing.assert_array_equal(lay.num_tokens_per_expert, want["num_tokens_per_expert"])
    np.testing.assert_array_equal(lay.expert_ends, want["expert_ends"])
    x = jnp.zeros((num_tokens, 128), jnp.bfloat16)
    copied = permute.permute(
        x, jnp.asarray(ids), num_experts=num_experts, expert_map=expert_map, alignment=ALIGNMENT
    )
    for name in ("expert_ids", "inverse", "num_tokens_per_expert", "expert_ends"):
        np.testing.assert_array_equal(getattr(lay, name), getattr(copied, name))


def test_route_refuses_float_ids():
    with pytest.raises(TypeError, match=r"int\[T, k\]"):
        permute.route(jnp.zeros((4, 2), jnp.float32), num_experts=2)


# --- the kernel -------------------------------------------------------------------------------


def _gathered(problem, *, config, interpret, num_sms=None, fn=gather.gathered_act_quant):
    rng = np.random.default_rng(oracles.seed("gathered", problem.name))
    x, w, x_scales, w_scales, ids = _operands(problem, rng)
    lay = oracles.permute(x, ids, problem.num_experts, alignment=ALIGNMENT, x_scales=x_scales)
    meta = oracles.routing_metadata(
        oracles.local_ids(ids, problem.num_experts),
        problem.num_experts,
        alignment=ALIGNMENT,
        num_rows=lay["rows"].shape[0],
    )
    q, s = fn(
        jnp.asarray(x),
        jnp.asarray(w),
        jnp.asarray(lay["expert_ids"], jnp.int32),
        jnp.asarray(meta["source"], jnp.int32),
        x_scales=jnp.asarray(x_scales),
        w1_scales=jnp.asarray(w_scales),
        options=mg.FusedGemm1Options(
            alignment=ALIGNMENT, config=config, num_sms=num_sms, interpret=interpret
        ),
    )
    return (q, s), (x, w, x_scales, w_scales, lay)


def _gathered_cases():
    """Compiled (on a GPU), each config on each problem. Interpreted (30-60 s a case on a 2-core
    CPU), each config once and each problem once: the heuristic on one token and empty experts,
    pairs over 3 programs on three blocks per expert (several tiles a program), overlapped
    pairs on ids outside [0, E); tests/test_contract_fused_gemm1.py runs the interpreted
    gathered kernel on more awkward problems, with its VJP."""
    configs = [("heuristic", None, None), ("pairs_3_sms", PAIRS, 3)]
    configs.append(("overlapped_pairs_5_sms", OVERLAPPED_PAIRS, 5))
    interpreted = {"heuristic": PROBLEMS[1], "pairs_3_sms": PROBLEMS[2]}
    interpreted["overlapped_pairs_5_sms"] = PROBLEMS[0]
    for name, config, num_sms in configs:
        for problem in PROBLEMS:
            case = (config, num_sms, problem)
            if interpreted[name] is problem:
                yield pytest.param(True, *case, id=f"{problem}-{name}-interpret")
            yield pytest.param(False, *case, id=f"{problem}-{name}-compiled", marks=pytest.mark.gpu)


@pytest.mark.parametrize(("interpret", "config", "num_sms", "problem"), list(_gathered_cases()))
def test_gathered_matches_float64_loop_and_the_contiguous_kernel(
    interpret, config, num_sms, problem
):
    """Ids outside [0, E), padding rows (source -1), empty experts, one token, three K blocks
    (one per step) and several tiles per program: against the float64 loop on the oracle's
    permuted rows; compiled, bit for bit the contiguous kernel on XLA's gathered rows."""
    (q, s), (x, w, x_scales, w_scales, lay) = _gathered(
        problem, config=config, interpret=interpret, num_sms=num_sms
    )
    inter = problem.n // 2
    assert q.shape == (lay["rows"].shape[0], inter) and q.dtype == FP8_DTYPE
    assert s.shape == (lay["rows"].shape[0], inter // 128) and s.dtype == jnp.float32
    _check_act_quant(q, s, x, w, x_scales, w_scales, lay)
    if interpret:
        return  # interpret mode runs the reference itself
    (q_ref, s_ref), _ = _gathered(
        problem,
        config=config,
        interpret=False,
        num_sms=num_sms,
        fn=gather.gathered_act_quant_reference,
    )
    valid = np.asarray(lay["expert_ids"]) >= 0
    np.testing.assert_array_equal(
        np.asarray(q.view(jnp.uint8))[valid], np.asarray(q_ref.view(jnp.uint8))[valid]
    )
    np.testing.assert_array_equal(np.asarray(s)[valid], np.asarray(s_ref)[valid])


def _gathered_call(**changes):
    """The front on small zero operands with `changes`."""
    args = dict(
        x_tokens=jnp.zeros((8, 128), FP8_DTYPE),
        w1=jnp.zeros((2, 256, 128), FP8_DTYPE),
        expert_ids=jnp.zeros((128,), jnp.int32),
        row_sources=jnp.zeros((128,), jnp.int32),
        x_scales=jnp.ones((8, 1)),
        w1_scales=jnp.ones((2, 2, 1)),
        alignment=ALIGNMENT,
        interpret=True,
    )
    args.update(changes)
    arrays = [args.pop(name) for name in ("x_tokens", "w1", "expert_ids", "row_sources")]
    scales = dict(x_scales=args.pop("x_scales"), w1_scales=args.pop("w1_scales"))
    return gather.gathered_act_quant(*arrays, **scales, options=mg.FusedGemm1Options(**args))


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        (dict(alignment=64), ValueError, "alignment=64"),
        (dict(row_sources=jnp.zeros((64,), jnp.int32)), ValueError, "row_sources"),
        (dict(row_sources=jnp.zeros((128,), jnp.float32)), ValueError, "row_sources"),
        (dict(x_scales=jnp.ones((8, 2))), ValueError, "x_scales"),
        (dict(x_tokens=jnp.zeros((8, 1, 128), FP8_DTYPE)), ValueError, "x_tokens"),
        (dict(x_tokens=jnp.zeros((8, 128), jnp.bfloat16)), TypeError, "float8_e4m3fn"),
        (dict(activation="relu"), ValueError, "relu"),
        (dict(config=mg.MosaicFp8GemmConfig(group_blocks=4)), ValueError, "groups of 1 or 2"),
    ],
)
def test_gathered_refuses_with_a_reason(changes, error, match):
    with pytest.raises(error, match=match):
        _gathered_call(**changes)


def test_gathered_no_tokens_and_no_gradient():
    q, s = _gathered_call(
        x_tokens=jnp.zeros((0, 128), FP8_DTYPE),
        x_scales=jnp.zeros((0, 1)),
        expert_ids=jnp.zeros((0,), jnp.int32),
        row_sources=jnp.zeros((0,), jnp.int32),
    )
    assert q.shape == (0, 128) and s.shape == (0, 1)

    def loss(tokens):
        q, s = fused_gemm1(
            tokens,
            jnp.zeros((2, 256, 128), FP8_DTYPE),
            jnp.zeros((128,), jnp.int32),
            x_scales=jnp.ones((8, 1)),
            w1_scales=jnp.ones((2, 2, 1)),
            alignment=ALIGNMENT,
            row_sources=jnp.zeros((128,), jnp.int32),
            impl="mosaic_fp8_gathered_interpret",
        )
        return jnp.sum(s)

    with pytest.raises(TypeError, match="no gradient"):
        jax.grad(loss)(jnp.zeros((8, 128), jnp.float32).astype(FP8_DTYPE))


def test_smem_leaves_out_the_extra_row_slot_where_it_does_not_fit(monkeypatch):
    """Shape B's config has room for the extra row slot (64 rows x 256 bytes and 128 scales);
    with one byte less of shared memory than that needs, the slot is left out."""
    config = mg.act_quant_heuristic_config(num_rows=81792, num_experts=128, k=2048, alignment=128)
    assert gather.extra_x_slots(config, 2048) == gather.X_EXTRA_SLOTS == 1
    needed = config.smem_bytes(jnp.bfloat16, 2048, is_gated=True) + 2 * (64 * 128 + 4 * 64)
    assert needed <= mg.SMEM_LIMIT
    monkeypatch.setattr(gather, "SMEM_LIMIT", needed)
    assert gather.extra_x_slots(config, 2048) == 1
    monkeypatch.setattr(gather, "SMEM_LIMIT", needed - 1)
    assert gather.extra_x_slots(config, 2048) == 0


@pytest.mark.skipif(
    not gather.has_inline_ptx(),
    reason="Mosaic GPU's inline_ptx (the kernel's copies) needs jax>=0.11",
)
def test_kernel_lowers_for_hopper_with_the_hardware_reporting_the_rows():
    """On any machine (CI's jax 0.11 pass): the compiled kernel lowers for sm_90, and its
    memory warpgroup never waits for its own copies: each thread's cp.asyncs are followed by
    `cp.async.mbarrier.arrive.noinc` on the slot's mbarrier (initialized for the warpgroup's
    128 threads), which the compute warpgroups wait on."""
    from hopper_lowering import lower_for_hopper

    num_tokens, k, inter, num_experts, num_rows = 8, 256, 128, 2, 256
    config = mg.act_quant_heuristic_config(
        num_rows=num_rows, num_experts=num_experts, k=k, alignment=ALIGNMENT
    )

    def launch(x, x_scales, sources, w, expert_ids, w_scales):
        return gather.launch_gathered(
            x,
            x_scales,
            sources,
            w,
            expert_ids,
            w_scales,
            n=inter,
            config=config,
            num_sms=4,
            activation="silu",
        )

    spec = jax.ShapeDtypeStruct
    text = lower_for_hopper(
        launch,
        spec((num_tokens, k), FP8_DTYPE),
        spec((num_tokens, k // 128), jnp.float32),
        spec((num_rows,), jnp.int32),
        spec((2 * num_experts, inter, k), FP8_DTYPE),
        spec((num_rows,), jnp.int32),
        spec((num_experts, 2 * inter // 128, k // 128), jnp.float32),
    ).as_text()
    assert "cp.async.cg.shared.global" in text
    assert "cp.async.mbarrier.arrive.noinc.shared::cta.b64" in text
    assert f"mbarrier.init.shared::cta.b64 [$0], {gather.THREADS}" in text
    assert "mbarrier.try_wait.parity" in text
    assert "cp.async.wait_group" not in text


# --- the backend and the layer --------------------------------------------------------------


def _fused_problem(**changes) -> FusedGemm1Problem:
    small = dict(n=256, k=256, num_experts=4, num_pairs=256, platform="cpu", alignment=128)
    gemm = dataclasses.replace(DEEPSEEK_V3_FP8_GEMM1, **{**small, **changes})
    return FusedGemm1Problem(gemm=gemm, activation="silu", group_size=128)


def test_auto_gathers_the_rows_up_to_gathered_max_n():
    """On a GPU at shape B's H (128-row segments) "auto" tries the gathered GEMM1 first up to
    N = 2I = `GATHERED_MAX_N`, the contiguous fused GEMM1 alone above (BENCHMARKS.md,
    Thresholds)."""
    from moe_jax.plan import THRESHOLDS, fused_gemm1_order

    limit = THRESHOLDS.GATHERED_MAX_N
    for n, want in ((limit, ("mosaic_fp8_gathered", "mosaic_fp8")), (limit + 256, ("mosaic_fp8",))):
        assert fused_gemm1_order(_fused_problem(platform="gpu", n=n, k=2048))[0] == want


def test_compiled_backend_refuses_a_jax_without_inline_ptx(monkeypatch):
    """On a Hopper GPU with a jax whose Mosaic GPU emits no inline PTX (0.10), the compiled
    backend says so and names the way out; the interpret twin (the reference) still runs."""
    problem = _fused_problem(platform="gpu", alignment=128)
    compiled = mg.MosaicFp8FusedGemm1(gathers_rows=True)
    monkeypatch.setattr(mg, "_compute_capability", lambda: mg.HOPPER)
    monkeypatch.setattr(gather, "has_inline_ptx", lambda: False)
    reason = compiled.unsupported_reason(problem)
    assert "inline PTX" in reason and "fused_act_quant='mosaic_fp8'" in reason
    interpret = mg.MosaicFp8FusedGemm1(gathers_rows=True, interpret=True)
    assert interpret.unsupported_reason(problem) is None
    monkeypatch.setattr(gather, "has_inline_ptx", lambda: True)
    assert compiled.unsupported_reason(problem) is None


def test_backend_refuses_other_segments_and_the_layer_routes():
    backend = FUSED_GEMM1S.get("mosaic_fp8_gathered_interpret")
    assert "128-row blocks" in backend.unsupported_reason(_fused_problem(alignment=64))
    weights = ExpertWeights(
        w1=jax.ShapeDtypeStruct((4, 512, 256), FP8_DTYPE),
        w2=jax.ShapeDtypeStruct((4, 256, 256), FP8_DTYPE),
    )
    for fused, gathers in (
        ("mosaic_fp8_gathered_interpret", True),
        ("mosaic_fp8_interpret", False),
    ):
        experts = ContiguousExperts(gemm="xla", alignment=ALIGNMENT, fused_act_quant=fused)
        plan = experts.plan_for(weights, num_tokens=128, topk=2, x_dtype=FP8_DTYPE)
        assert plan.fuses_act_quant and plan.gathers_rows == gathers
        assert plan.arrange == ("route" if gathers else "permute")


@pytest.mark.parametrize(
    ("fused", "has_rows"),
    [("mosaic_fp8_gathered_interpret", False), ("mosaic_fp8_interpret", True)],
)
def test_arrange_routes_where_gemm1_gathers_and_permutes_elsewhere(fused, has_rows):
    """`ContiguousExperts.arrange` (what the layer and `stage_breakdown` run): the rowless
    route for a gathering GEMM1, with each row's token; else the permuted rows, which equal
    the tokens at those rows. The two agree on where every pair goes."""
    experts = ContiguousExperts(gemm="xla", alignment=ALIGNMENT, fused_act_quant=fused)
    rng = np.random.default_rng(oracles.seed("arrange", fused))
    ids = jnp.asarray(rng.integers(-1, 3, size=(6, 2)), jnp.int32)
    x = jnp.asarray(rng.standard_normal((6, 128)), jnp.float32).astype(FP8_DTYPE)
    prepared = PreparedTokens(
        x=x, x_scales=jnp.ones((6, 1)), topk_ids=ids, topk_weights=jnp.ones((6, 2))
    )
    weights = ExpertWeights(
        w1=jnp.zeros((2, 256, 128), FP8_DTYPE),
        w2=jnp.zeros((2, 128, 128), FP8_DTYPE),
        w1_scale=jnp.ones((2, 2, 1)),
        w2_scale=jnp.ones((2, 1, 1)),
    )
    plan = experts.plan_for(weights, num_tokens=6, topk=2, x_dtype=FP8_DTYPE)
    lay = experts.arrange(prepared, weights, expert_map=None, plan=plan)
    routed = permute.route(ids, num_experts=2, alignment=ALIGNMENT)
    np.testing.assert_array_equal(np.asarray(lay.inverse), np.asarray(routed.inverse))
    np.testing.assert_array_equal(np.asarray(lay.expert_ids), np.asarray(routed.expert_ids))
    assert (lay.rows is not None) == has_rows
    if has_rows:
        sources = np.asarray(routed.sources)
        valid = sources >= 0
        np.testing.assert_array_equal(
            np.asarray(lay.rows).view(np.uint8)[valid],
            np.asarray(x).view(np.uint8)[sources[valid]],
        )
    else:
        np.testing.assert_array_equal(np.asarray(lay.sources), np.asarray(routed.sources))


def test_the_rowless_layout_needs_the_tokens():
    experts = ContiguousExperts(
        gemm="xla", alignment=128, fused_act_quant="mosaic_fp8_gathered_interpret"
    )
    lay = permute.route(jnp.zeros((4, 1), jnp.int32), num_experts=2, alignment=128)
    weights = ExpertWeights(
        w1=jnp.zeros((2, 256, 128), FP8_DTYPE),
        w2=jnp.zeros((2, 128, 128), FP8_DTYPE),
        w1_scale=jnp.ones((2, 2, 1)),
        w2_scale=jnp.ones((2, 1, 1)),
    )
    call = ExpertsCall(quant_config=Fp8BlockQuant())
    plan = experts.plan_for(weights, num_tokens=4, topk=1, x_dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="pass prepared="):
        experts.first_gemm_act_quant(lay, weights, plan=plan, call=call)


@pytest.mark.parametrize(
    ("gemm", "num_tokens"),
    [
        ("xla", 70),
        pytest.param("deep_gemm", 70, marks=pytest.mark.gpu),
        pytest.param("deep_gemm", 1, marks=pytest.mark.gpu),
    ],
)
def test_fused_moe_with_the_gathered_first_gemm(gemm, num_tokens):
    """The layer with the gathered GEMM1 (128-row segments) equals the layer with the
    contiguous fused GEMM1 bit for bit (the same codes into the same GEMM2 and weighted sum):
    ids outside [0, E), an expert twice in a row, negative router weights and global experts
    held elsewhere (`expert_map`) in one call. Interpreted, one token is the experts contract's
    (tests/test_contract_experts.py, "xla+mosaic_fp8_gathered_interpret" at T=1)."""
    suffix = "_interpret" if gemm == "xla" else ""  # GEMM1 in interpret mode beside XLA's GEMM2
    args, scales = _fp8_layer(oracles.seed("gathered_layer", gemm, num_tokens))
    x, w1, w2, weights, ids = args
    x, weights, ids = x[:num_tokens], weights[:num_tokens], ids[:num_tokens]
    # global experts 0-7, the even ones held here as 0-3
    kwargs = dict(scales, global_num_experts=8)
    kwargs["expert_map"] = jnp.where(jnp.arange(8) % 2 == 0, jnp.arange(8) // 2, -1)
    ids = jnp.where(ids >= 0, 2 * ids, ids)

    def layer(fused):
        experts = ContiguousExperts(gemm=gemm, alignment=ALIGNMENT, fused_act_quant=fused + suffix)
        return fused_moe(x, w1, w2, weights, ids, experts=experts, **kwargs)

    got, want = layer("mosaic_fp8_gathered"), layer("mosaic_fp8")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert np.isfinite(np.asarray(got, np.float32)).all()


def test_a_permuted_layout_has_no_sources():
    """`layouts.ContiguousLayout.sources` is None on a permuted layout."""
    lay = permute.permute(jnp.ones((2, 128)), jnp.array([[1], [0]]), num_experts=2, alignment=1)
    assert lay.sources is None and isinstance(lay, layouts.ContiguousLayout)
