"""CPU tests of the DeepEP adapters' pure-JAX side (`moe_jax.interop.deep_ep_layouts`).

DeepEP itself does not run here. The receive buffers below are built by plain NumPy loops from
DeepEP's documented contracts (V1 `Buffer.dispatch` / `low_latency_dispatch`): HT delivers each
token with a local expert once, with local ids or -1 and zeroed weights, padded to num_worst_tokens
rows; LL delivers one row per (token, local expert) in [E_local, R * T_max, H] with stale rows after
the count. Summing every rank's result as DeepEP's combine does must give single-device `fused_moe`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest

from moe_jax import (
    ContiguousExperts,
    ExpertWeights,
    MaskedExperts,
    ModularMoE,
    fused_moe,
    layouts,
    quant,
)
from moe_jax.expert_parallel import expert_map_for_rank
from moe_jax.experts import ExpertsCall
from moe_jax.interop import deep_ep_layouts as dl
from moe_jax.prepare_finalize import MaskedTokens

R, E, T_RANK, K, H, INTER = 4, 8, 3, 3, 128, 128
E_LOCAL = E // R
# FP8 against fused_moe: `oracles.assert_moe_close`'s flipped-row policy (a different float32 sum
# order in GEMM1, here masked vs contiguous layout, can move one requantized code), around 3e-2.
FP8_TOL = dict(rtol=3e-2, atol=3e-2)


def make_problem(fp8: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    t = R * T_RANK
    ids = rng.integers(0, E, size=(t, K))
    ids[0] = [1, 1, 6]  # a duplicate and two ranks in one row
    x = jnp.asarray(rng.standard_normal((t, H)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((E, 2 * INTER, H)) / np.sqrt(H), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((E, H, INTER)) / np.sqrt(INTER), jnp.float32)
    scales = {}
    if fp8:
        x = x.astype(jnp.bfloat16)
        w1, scales["w1_scale"] = quant.per_block_quant_fp8(w1)
        w2, scales["w2_scale"] = quant.per_block_quant_fp8(w2)
    weights = jnp.asarray(rng.standard_normal((t, K)), jnp.float32)
    return x, w1, w2, weights, ids, scales


def local_weights(w1, w2, scales, r):
    own = slice(r * E_LOCAL, (r + 1) * E_LOCAL)
    s1, s2 = scales.get("w1_scale"), scales.get("w2_scale")
    return ExpertWeights(
        w1=w1[own],
        w2=w2[own],
        w1_scale=None if s1 is None else s1[own],
        w2_scale=None if s2 is None else s2[own],
    )


@pytest.mark.parametrize("fp8", [False, True], ids=["f32", "fp8"])
def test_ht_receive_rewrite_and_combine_equal_fused_moe(fp8):
    x, w1, w2, weights, ids, scales = make_problem(fp8)
    quant_config = quant.Fp8BlockQuant() if fp8 else None
    xq, xs = quant_config.quantize_activations(x) if fp8 else (x, None)  # before dispatch
    num_worst = R * T_RANK
    total = np.zeros((x.shape[0], H))
    for r in range(R):
        # DeepEP HT receive on rank r: tokens with >= 1 local expert, once, in source order.
        tokens = [t for t in range(x.shape[0]) if any(e // E_LOCAL == r for e in ids[t])]
        recv_idx = np.full((num_worst, K), -1)
        recv_w = np.full((num_worst, K), np.nan, np.float32)  # padding rows: garbage weights
        for row, t in enumerate(tokens):
            is_local = ids[t] // E_LOCAL == r
            recv_idx[row] = np.where(is_local, ids[t] - r * E_LOCAL, -1)
            recv_w[row] = np.where(is_local, weights[t], 0.0)
        pick = jnp.asarray(tokens + [0] * (num_worst - len(tokens)))
        prepared = dl.ht_prepared_tokens(
            xq[pick],
            None if xs is None else xs[pick],
            jnp.asarray(recv_idx, jnp.int32),
            jnp.asarray(recv_w),
            rank=r,
            num_local_experts=E_LOCAL,
            num_experts=E,
        )
        counts = layouts.count_expert_num_tokens(jnp.asarray(recv_idx), E_LOCAL)
        expected_counts = [np.sum(ids[tokens] == r * E_LOCAL + e) for e in range(E_LOCAL)]
        assert counts.tolist() == expected_counts
        partial = ContiguousExperts(gemm="xla").apply(
            prepared,
            local_weights(w1, w2, scales, r),
            expert_map=expert_map_for_rank(E, R, r),
            call=ExpertsCall(quant_config=quant_config, out_dtype=jnp.float32),
        )
        for row, t in enumerate(tokens):  # HT combine: unweighted sum of partial outputs
            total[t] += np.asarray(partial[row], np.float64)
    expected = fused_moe(x, w1, w2, weights, jnp.asarray(ids), experts="xla", **scales)
    tol = 3e-2 if fp8 else 1e-5
    np.testing.assert_allclose(total, np.asarray(expected, np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_ll_masked_layout_scales_and_combine_equal_fused_moe(fp8):
    x, w1, w2, weights, ids, scales = make_problem(fp8, seed=1)
    x = x.astype(jnp.bfloat16)
    quant_config = quant.Fp8BlockQuant() if fp8 else None
    max_tokens = T_RANK + 1
    t_tot = R * max_tokens
    total = np.zeros((x.shape[0], H))
    for r in range(R):
        # DeepEP LL receive on rank r: one row per (token, local expert), by source rank.
        rows = np.full((E_LOCAL, t_tot, H), np.nan, np.float32)  # stale rows: NaN
        row_of = {}
        counts = np.zeros(E_LOCAL, np.int32)
        for t in range(x.shape[0]):
            for j in range(K):
                if ids[t, j] // E_LOCAL == r:
                    e = ids[t, j] - r * E_LOCAL
                    row_of[t, j] = (e, counts[e])
                    rows[e, counts[e]] = np.asarray(x[t], np.float32)
                    counts[e] += 1
        rows = jnp.asarray(rows, jnp.bfloat16)
        row_scales = None
        if fp8:
            q, s = quant.per_token_group_quant_fp8(jnp.nan_to_num(rows.astype(jnp.float32)))
            rows = jnp.where(jnp.isnan(rows), jnp.nan, q.astype(jnp.float32)).astype(q.dtype)
            storage = jnp.swapaxes(jnp.where(jnp.isnan(rows[..., ::128]), jnp.nan, s), 1, 2)
            assert storage.shape == (E_LOCAL, H // 128, t_tot)
            row_scales = dl.ll_scales_from_storage(storage)
        sent = slice(r * T_RANK, (r + 1) * T_RANK)  # the tokens rank r dispatched
        tokens = MaskedTokens(
            x=rows,
            x_scales=row_scales,
            topk_ids=jnp.asarray(ids[sent]),
            topk_weights=weights[sent],
            num_tokens_per_expert=jnp.asarray(counts),
        )
        y = MaskedExperts(gemm="xla").apply(
            tokens,
            local_weights(w1, w2, scales, r),
            expert_map=None,
            call=ExpertsCall(quant_config=quant_config, out_dtype=jnp.bfloat16),
        )
        assert y.shape == (E_LOCAL, t_tot, H)
        for (t, j), (e, row) in row_of.items():  # LL combine: weighted sum of valid rows only
            assert not np.isnan(np.asarray(y[e, row], np.float32)).any()
            total[t] += float(weights[t, j]) * np.asarray(y[e, row], np.float64)
    expected = fused_moe(x, w1, w2, weights, jnp.asarray(ids), experts="xla", **scales)
    if fp8:
        oracles.assert_moe_close(total, np.asarray(expected, np.float64), "fp8", tol=FP8_TOL)
    else:
        np.testing.assert_allclose(total, np.asarray(expected, np.float64), rtol=3e-2, atol=3e-2)


def test_ht_id_rewrite_round_trips_through_expert_map():
    local = jnp.array([[0, 1, -1], [-1, -1, 1]])
    for r in range(R):
        rewritten = dl.ht_global_topk_ids(local, rank=r, num_local_experts=E_LOCAL, num_experts=E)
        back = expert_map_for_rank(E, R, r)[rewritten]
        assert back.tolist() == local.tolist()


def test_ll_scale_view():
    storage = jnp.arange(2 * 3 * 5, dtype=jnp.float32).reshape(2, 3, 5)  # [E, G, T]
    view = dl.ll_scales_from_storage(storage)
    assert view.shape == (2, 5, 3) and float(view[1, 4, 2]) == float(storage[1, 2, 4])


def test_dispatch_ids_and_limits():
    assert dl.dispatch_topk_ids(jnp.array([[3, -4, 8, 0]]), num_experts=8).tolist() == [
        [3, -1, -1, 0]
    ]
    with pytest.raises(ValueError, match=r"\(2, 4, 8\) ranks"):
        dl.check_ht(num_ranks=3, hidden=7168, hidden_itemsize=2)
    dl.check_ht(num_ranks=8, hidden=7168, hidden_itemsize=2)
    # 16-byte rows: H=7176 is fine in bf16 (14352 bytes) but not in FP8 (7176 bytes).
    dl.check_ht(num_ranks=2, hidden=7176, hidden_itemsize=2)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        dl.check_ht(num_ranks=2, hidden=7176, hidden_itemsize=1)
    with pytest.raises(ValueError, match="one scale per 128"):
        dl.check_ht(num_ranks=2, hidden=7184, hidden_itemsize=1)
    ok = dict(
        num_ranks=8,
        hidden=7168,
        num_topk=8,
        num_max_tokens_per_rank=128,
        num_experts=256,
        use_fp8=True,
    )
    dl.check_ll(**ok)
    for bad, match in [
        (dict(hidden=1000), "hidden sizes"),
        (dict(num_topk=12), "1..11"),
        (dict(num_max_tokens_per_rank=600), "queue depth"),
        (dict(num_ranks=3, num_max_tokens_per_rank=3, num_experts=9), "multiple of 4"),
        (dict(num_experts=100), "multiple of num_ranks"),
    ]:
        with pytest.raises(ValueError, match=match):
            dl.check_ll(**{**ok, **bad})


def test_adapters_refuse_unsupported_problems_before_touching_deep_ep():
    from moe_jax.interop import deep_ep_ht as dep_ht
    from moe_jax.interop import deep_ep_ll as dep_ll

    problem = dict(rank=0, num_experts=64, num_tokens=128, hidden=7168, num_topk=8)
    with pytest.raises(ValueError, match="2, 4, 8"):
        dep_ht.DeepEPHighThroughput(buffer=None, problem=dl.DeepEPProblem(num_ranks=3, **problem))
    with pytest.raises(ValueError, match="even SM count"):
        dep_ht.DeepEPHighThroughput(
            buffer=None, problem=dl.DeepEPProblem(num_ranks=2, **problem), num_sms=21
        )
    with pytest.raises(ValueError, match="hidden sizes"):
        dep_ll.DeepEPLowLatency(
            buffer=None, problem=dl.DeepEPProblem(num_ranks=8, **{**problem, "hidden": 1000})
        )
    with pytest.raises(ValueError, match="recv_copy"):
        dep_ll.DeepEPLowLatency(
            buffer=None, problem=dl.DeepEPProblem(num_ranks=8, **problem), recv_copy="some"
        )
    assert dl.DeepEPProblem(num_ranks=8, **problem).num_local_experts == 8
    ll = dep_ll.DeepEPLowLatency(buffer=None, problem=dl.DeepEPProblem(num_ranks=8, **problem))
    with pytest.raises(ValueError, match="DeepEPLowLatency delivers the masked activation format"):
        ModularMoE(ll, ContiguousExperts())
    with pytest.raises(ValueError, match="chunk_size=64 but DeepEPLowLatency delivers masked"):
        ModularMoE(ll, MaskedExperts(), chunk_size=64)


def test_ll_receive_copy_is_chosen_through_its_registry():
    from moe_jax.interop import deep_ep_ll as dep_ll
    from moe_jax.registry import NoImplementationError, OpProblem

    copies = dep_ll.RECV_COPIES
    assert set(copies.names()) == set(dep_ll.LL_RECV_COPIES) - {"auto"}
    cpu, gpu = (
        OpProblem(platform="cpu", dtype="bfloat16"),
        OpProblem(platform="gpu", dtype="bfloat16"),
    )
    assert copies.select("auto", cpu).name == "all_rows"
    assert copies.preference(gpu) == ("valid_rows", "all_rows")
    with pytest.raises(NoImplementationError, match="valid_rows: a GPU \\(Triton\\) kernel"):
        copies.select("valid_rows", cpu)
    with pytest.raises(ValueError, match="unknown recv_copy implementation 'some'.*all_rows"):
        copies.get("some")


def test_valid_rows_copy_config_names_a_bad_tiling():
    from moe_jax.interop import deep_ep_ll as dep_ll

    assert dep_ll.VALID_ROWS_COPY == dep_ll.ValidRowsCopyConfig(
        block_t=4, block_w=1024, num_warps=8
    )
    for bad in ({"block_t": 3}, {"block_w": 0}, {"num_warps": 6}):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=f"ValidRowsCopyConfig.{name}=.*power of two"):
            dep_ll.ValidRowsCopyConfig(**bad)


def test_topk_idx_words_are_int64_bytes():
    ids = np.array([[0, 5, -1], [7, 8, -3]])
    words = np.asarray(dl.topk_idx_words(jnp.asarray(ids, jnp.int32), num_experts=8))
    assert words.dtype == np.int32 and words.shape == (2, 3, 2)
    expected = np.where((ids >= 0) & (ids < 8), ids, -1).astype(np.int64)
    np.testing.assert_array_equal(np.ascontiguousarray(words).view("<i8")[..., 0], expected)


def test_ht_handle_shapes_name_every_part():
    problem = dl.DeepEPProblem(
        num_ranks=4, rank=1, num_experts=16, num_tokens=6, hidden=256, num_topk=2
    )
    shapes = dl.HTHandle.shapes(problem, num_channels=10)
    assert shapes.rank_prefix_matrix.shape == (4, 4)
    assert shapes.channel_prefix_matrix.shape == shapes.recv_channel_prefix_matrix.shape == (4, 10)
    assert shapes.recv_src_idx.shape == (24,)
    assert shapes.is_token_in_rank.shape == (6, 4) and shapes.is_token_in_rank.dtype == jnp.int8
    assert shapes.send_head.shape == (6, 4)
    assert len(jax.tree.leaves(shapes)) == 6  # crosses jit as a pytree


class FakeLowLatencyBuffer:
    """DeepEP V1's `low_latency_dispatch`/`low_latency_combine` on one rank (R=1), in torch,
    written from the documented contract: [E, T_max, H] receive rows (one per selected expert,
    stale rows NaN), FP8 scales allocated [E, H/128, T_max] and returned transposed, int64 ids, a
    (src_info, layout_range, T_max, H, E) handle, and a weighted combine into `out`. It computes
    on the CPU and returns tensors on x's device (a GPU where JAX runs on one, as DeepEP does).
    """

    def __init__(self, torch):
        self.torch = torch
        self.calls = []
        # DeepEP's two LL buffers: each call uses the next one and flips (the host-side index).
        self.ll_buffers = [torch.zeros(1), torch.zeros(1)]

    def get_next_low_latency_combine_buffer(self, handle):
        return self.ll_buffers[len(self.calls) % 2]

    def low_latency_dispatch(self, x, topk_idx, num_max, num_experts, *, use_fp8, **_):
        torch = self.torch
        self.calls.append("dispatch")
        if topk_idx.dtype != torch.int64 or x.dtype != torch.bfloat16:
            raise TypeError(f"{topk_idx.dtype=}, {x.dtype=}: DeepEP wants int64 ids, bf16 x")
        device, x, topk_idx = x.device, x.cpu(), topk_idx.cpu()
        hidden = x.shape[1]
        rows = torch.full((num_experts, num_max, hidden), float("nan"), dtype=torch.float32)
        src_info = torch.full((num_experts, num_max), -7, dtype=torch.int32)
        count = torch.zeros(num_experts, dtype=torch.int32)
        for t in range(x.shape[0]):
            for e in topk_idx[t].tolist():
                if e >= 0:
                    rows[e, count[e]] = x[t].float()
                    src_info[e, count[e]] = t
                    count[e] += 1
        layout_range = count.to(torch.int64)[:, None]  # opaque to the adapter
        src_info, layout_range, count = (a.to(device) for a in (src_info, layout_range, count))
        handle = (src_info, layout_range, num_max, hidden, num_experts)
        if not use_fp8:
            return rows.to(device, torch.bfloat16), count, handle, None, None
        groups = rows.reshape(num_experts, num_max, hidden // 128, 128)
        amax = groups.abs().amax(-1).clamp(min=1e-4)
        q = (groups * (448.0 / amax[..., None])).reshape(rows.shape).to(torch.float8_e4m3fn)
        storage = (amax / 448.0).transpose(1, 2).contiguous().to(device)  # [E, G, T_max]
        return (q.to(device), storage.transpose(1, 2)), count, handle, None, None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, *, out, **_):
        torch = self.torch
        self.calls.append("combine")
        src_info, layout_range, _, _, _ = handle
        if layout_range.dtype != torch.int64 or topk_idx.dtype != torch.int64:
            raise TypeError("the handle's layout_range and the ids must be int64")
        x, topk_idx, topk_weights = x.cpu(), topk_idx.cpu(), topk_weights.cpu()
        src_info, layout_range = src_info.cpu(), layout_range.cpu()
        acc = torch.zeros(out.shape, dtype=torch.float32)
        for e in range(x.shape[0]):
            for i in range(int(layout_range[e, 0])):
                t = int(src_info[e, i])
                for j in range(topk_idx.shape[1]):
                    if int(topk_idx[t, j]) == e:
                        acc[t] += float(topk_weights[t, j]) * x[e, i].float()
        out.copy_(acc.to(torch.bfloat16))
        return out, None, None


@pytest.mark.parametrize(
    "fp8,topk", [(False, 2), (True, 2), (False, 1)], ids=["bf16", "fp8", "bf16-weight_on_input"]
)
def test_ll_moe_through_modular_moe_with_a_fake_deep_ep_equals_fused_moe(fp8, topk, monkeypatch):
    """ModularMoE(DeepEPLowLatency, MaskedExperts) under jit: one dispatch and one combine, the
    result within bf16/FP8 tolerance of fused_moe."""
    torch = pytest.importorskip("torch", reason="the DeepEP adapters call DeepEP through torch")
    import sys
    import types

    from moe_jax.interop import deep_ep_ll as dep_ll

    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(topk_idx_t=torch.int64))
    rng = np.random.default_rng(7)
    num_tokens, num_experts, hidden, inter, t_max = 5, 4, 2048, 128, 8
    on_input = topk == 1
    ids = np.stack([rng.permutation(num_experts)[:topk] for _ in range(num_tokens)])
    ids[3, -1] = -1  # a slot routed nowhere
    x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((num_experts, 2 * inter, hidden)) / 45, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((num_experts, hidden, inter)) / 11, jnp.float32)
    weights = jnp.asarray(rng.random((num_tokens, topk)) * (3 if on_input else 1), jnp.float32)
    scales = {}
    if fp8:
        w1, scales["w1_scale"] = quant.per_block_quant_fp8(w1)
        w2, scales["w2_scale"] = quant.per_block_quant_fp8(w2)
    else:
        w1, w2 = w1.astype(jnp.bfloat16), w2.astype(jnp.bfloat16)
    buffer = FakeLowLatencyBuffer(torch)
    problem = dl.DeepEPProblem(
        num_ranks=1,
        rank=0,
        num_experts=num_experts,
        num_tokens=t_max,
        hidden=hidden,
        num_topk=topk,
    )
    ll = dep_ll.DeepEPLowLatency(buffer=buffer, problem=problem, use_fp8=fp8)
    layer = ModularMoE(ll, MaskedExperts(gemm="xla"))
    ids = jnp.asarray(ids, jnp.int32)
    kwargs = dict(apply_router_weight_on_input=on_input, **scales)
    out = jax.jit(lambda *a: layer(*a, **kwargs))(x, w1, w2, weights, ids)
    # The callbacks run when XLA executes the program, which is asynchronous to this thread (on
    # a GPU the combine had not run yet when the call returned): wait for the result first.
    out = jax.block_until_ready(out)
    assert buffer.calls == ["dispatch", "combine"]
    expected = fused_moe(x, w1, w2, weights, ids, experts="xla", **kwargs)
    out, expected = np.asarray(out, np.float64), np.asarray(expected, np.float64)
    error = np.linalg.norm(out - expected) / np.linalg.norm(expected)
    assert error < (3e-2 if fp8 else 1e-2), error


def _fake_ll(torch, monkeypatch, **kwargs):
    import sys
    import types

    from moe_jax.interop import deep_ep_ll as dep_ll

    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(topk_idx_t=torch.int64))
    problem = dl.DeepEPProblem(
        num_ranks=1, rank=0, num_experts=4, num_tokens=8, hidden=2048, num_topk=2
    )
    buffer = FakeLowLatencyBuffer(torch)
    return buffer, dep_ll.DeepEPLowLatency(buffer=buffer, problem=problem, **kwargs)


def _round_trip_inputs(seed: int):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(4)[:2] for _ in range(5)])
    ids[1, 0] = -1  # a slot routed nowhere
    ids[2] = [-1, 9]  # a token routed nowhere (9 is outside [0, E))
    x = jnp.asarray(rng.standard_normal((5, 2048)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((4, 8, 2048)), jnp.bfloat16)
    weights = jnp.asarray(rng.random((5, 2)), jnp.float32)
    return x, y, weights, jnp.asarray(ids, jnp.int32)


def test_ll_command_buffer_mode_pairs_dispatch_and_combine_on_deep_eps_buffers(monkeypatch):
    """Command-buffer mode on the CPU (no capture there: every call runs the host side): the
    warm-up fixes the dispatch buffer, each round trip checks the pairing and counts its host
    calls, and results equal the eager adapter's."""
    torch = pytest.importorskip("torch", reason="the DeepEP adapters call DeepEP through torch")
    if jax.default_backend() == "gpu":
        pytest.skip(
            "the fake DeepEP computes on the CPU, which XLA's CUDA-graph capture of the callbacks "
            "cannot record; tests/test_deep_ep_gpu.py runs this mode with DeepEP on the GPU"
        )
    buffer, ll = _fake_ll(torch, monkeypatch, use_fp8=False, command_buffer_compatible=True)
    _, eager = _fake_ll(torch, monkeypatch, use_fp8=False)
    x, y, weights, ids = _round_trip_inputs(3)

    def round_trip(ll, x, y, weights, ids):
        return ll.combine(y, ids, weights, ll.dispatch(x, ids))

    with pytest.raises(ValueError, match="warm_up"):
        jax.jit(lambda *a: round_trip(ll, *a))(x, y, weights, ids)
    ll.warm_up()
    assert buffer.calls == ["dispatch", "combine"]
    assert ll.capture.dispatch_buffer_address == buffer.ll_buffers[0].data_ptr()
    assert ll.capture.num_host_calls == 0  # the warm-up is not a checked call
    ours = jax.jit(lambda *a: round_trip(ll, *a))
    for _ in range(2):
        got = jax.block_until_ready(ours(x, y, weights, ids))
    assert ll.capture.num_host_calls == 4
    want = jax.block_until_ready(jax.jit(lambda *a: round_trip(eager, *a))(x, y, weights, ids))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.asarray(got[2], np.float32).any()  # the token routed nowhere stays zero


def test_ll_command_buffer_mode_refuses_a_call_on_the_wrong_buffer(monkeypatch):
    """An unpaired DeepEP call (here a direct dispatch) leaves DeepEP's next buffer on the
    combine side: the next captured dispatch would break the alternation on replay, so the
    callback raises instead of calling DeepEP."""
    torch = pytest.importorskip("torch", reason="the DeepEP adapters call DeepEP through torch")
    buffer, ll = _fake_ll(torch, monkeypatch, use_fp8=False, command_buffer_compatible=True)
    x, _, _, ids = _round_trip_inputs(4)
    ll.warm_up()
    buffer.low_latency_dispatch(
        torch.zeros((1, 2048), dtype=torch.bfloat16),
        torch.full((1, 2), -1, dtype=torch.int64),
        8,
        4,
        use_fp8=False,
    )
    calls = len(buffer.calls)
    with pytest.raises(Exception, match="no longer paired"):
        jax.block_until_ready(jax.jit(ll.dispatch)(x, ids))
    assert len(buffer.calls) == calls and ll.capture.num_host_calls == 0
    # On a GPU, JAX keeps the failed call's runtime token as the device's last effect and its
    # exit-time effects barrier would raise the refusal again; one effectful call that succeeds
    # takes its place.
    jax.jit(lambda: jax.debug.callback(lambda: None))()
    jax.effects_barrier()
    with pytest.raises(ValueError, match="one of"):
        ll.capture.check("send")


def test_missing_deep_ep_says_why_and_what_to_do():
    import importlib.util

    from moe_jax.interop import deep_ep as dep

    if importlib.util.find_spec("deep_ep") is not None:
        pytest.skip("deep_ep is installed here")
    with pytest.raises(ImportError, match="tokenspeed-deepep==1.2.1") as info:
        dep.import_deep_ep()
    assert "2.28.9" in str(info.value) and "moe_jax.expert_parallel" in str(info.value)
