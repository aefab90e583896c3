"""Expert parallelism on 2 (4, 8) GPUs: DeepEP high-throughput and low-latency through moe_jax, and
the JAX-native all-to-all EP, each checked against single-device `fused_moe` on the same global
problem and timed against direct DeepEP calls / the single-GPU layer; the low-latency layer and
round trip also in command-buffer mode (`DeepEPLowLatency(command_buffer_compatible=True)`).

Run on a host with R GPUs (after `source .gpu/install.sh`; `bash scripts/gpu_check.sh ep` runs it
on every GPU, then on 2, then `pytest -m multigpu`):

    python -m moe_jax.distributed --num-processes 2 scripts/ep_multigpu.py [--quick] [--parts ..]

Parts: "ht" (also tries `jax.grad` through DeepEP HT: refused while its callbacks have no VJP),
"ll", "jax" (transports timed, with the all-to-all traffic alone, `exchange_us`), "grad"
(`jax.grad` through `ep_fused_moe` against single-device `fused_moe`'s, float32 and bf16). "jax" and
"grad" also run on CPU processes or devices (XLA:CPU lacks the ragged all-to-all: skipped there).

Every process builds the same global inputs from one seed, keeps its T tokens and E / R experts
(rank r owns experts [r * E / R, (r + 1) * E / R)), and computes the global `fused_moe` itself
for the check. Prints JSON lines, then rank 0 one "target" line per target of issue 64 (PASS,
MISS or NOT MEASURED, with the numbers); exit status 1 if a check failed.
Timing: medians over samples of bursts, one device sync per burst (METHOD.md).
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import ContiguousExperts, MaskedExperts, ModularMoE, distributed, fused_moe, quant
from moe_jax.cli.timing import time_calls
from moe_jax.ep_api import ep_fused_moe
from moe_jax.expert_parallel import TRANSPORTS, EPConfig, expert_map_for_rank, send_slots
from moe_jax.experts import ExpertWeights
from moe_jax.grouped_gemm import dequant_rows
from moe_jax.interop import deep_ep as dep
from moe_jax.interop import deep_ep_ht as dep_ht
from moe_jax.interop import deep_ep_layouts as dl
from moe_jax.interop import deep_ep_ll as dep_ll

FAILURES: list[str] = []
TIMINGS: dict[str, dict] = {}  # this rank's timing rows by name, for the targets
# Gradient checks' relative error bounds (norm-wise), per dtype of x and the weights: float32 GEMMs
# may run in TF32 on GPUs; bf16 rounds the layer's intermediates in a different order.
GRAD_RTOL = {"float32": {"cpu": 1e-5, "gpu": 5e-3}, "bfloat16": {"cpu": 3e-2, "gpu": 3e-2}}


def report(ctx, **row) -> None:
    if "timing" in row:
        TIMINGS[row["timing"]] = row
    # one write per line: the ranks share the launcher's stdout
    print(json.dumps({"rank": ctx.process_id, **row}) + "\n", end="", flush=True)


def check(ctx, name, err, bound, **row) -> None:
    """Reports `name`'s relative error against `bound` and records a failure past it."""
    report(ctx, check=name, rel_error=err, bound=bound, ok=err < bound, **row)
    if not err < bound:
        FAILURES.append(name)


def global_problem(*, tokens, experts, topk, hidden, inter, fp8, seed):
    """Identical on every rank: (x [R*T, H], w1, w2 (, scales), weights, ids) as NumPy/JAX."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(experts)[:topk] for _ in range(tokens)]).astype(np.int32)
    logits = rng.standard_normal((tokens, topk))
    weights = (np.exp(logits) / np.exp(logits).sum(1, keepdims=True)).astype(np.float32)
    # float32 draws: float64 weights at E=32, H=7168 take 7.5 GB of host memory per process
    normal = functools.partial(rng.standard_normal, dtype=np.float32)
    x = jnp.asarray(normal((tokens, hidden)), jnp.bfloat16)
    w1 = jnp.asarray(normal((experts, 2 * inter, hidden)) / np.sqrt(hidden))
    w2 = jnp.asarray(normal((experts, hidden, inter)) / np.sqrt(inter))
    scales = {}
    if fp8:
        w1, scales["w1_scale"] = quant.per_block_quant_fp8(w1.astype(jnp.float32))
        w2, scales["w2_scale"] = quant.per_block_quant_fp8(w2.astype(jnp.float32))
    else:
        w1, w2 = w1.astype(jnp.bfloat16), w2.astype(jnp.bfloat16)
    return x, w1, w2, scales, jnp.asarray(weights), jnp.asarray(ids)


def rel_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def local_error(a, ref) -> float:
    """`rel_error` of this process's shards of the global array `a` against the global `ref`."""
    ref, shards = np.asarray(ref, np.float64), a.addressable_shards
    ours = np.concatenate([np.asarray(s.data, np.float64).ravel() for s in shards])
    return rel_error(ours, np.concatenate([ref[s.index].ravel() for s in shards]))


def burst_us(fn, sync, *, burst=10, samples=20) -> float:
    """Streamed us per call, by the benchmarks' one timing loop (`moe_jax.cli.timing.time_calls`);
    every rank makes the same number of calls, so collectives stay in step."""
    return time_calls(fn, wait=sync, samples=samples, burst=burst).streamed_ms * 1e3


def local_slices(ctx, x, w1, w2, scales, weights, ids):
    r, n = ctx.process_id, ctx.num_processes
    t, e = x.shape[0] // n, w1.shape[0] // n
    tok, own = slice(r * t, (r + 1) * t), slice(r * e, (r + 1) * e)
    ew = ExpertWeights(
        w1=w1[own],
        w2=w2[own],
        w1_scale=scales["w1_scale"][own] if scales else None,
        w2_scale=scales["w2_scale"][own] if scales else None,
    )
    return x[tok], ew, weights[tok], ids[tok], tok


def jitted_layer(layer: ModularMoE, **kwargs):
    """`layer` under jax.jit on (x, this rank's `ExpertWeights`, topk_weights, topk_ids)."""

    def run(x, ew, w, ids):
        return layer(
            x, ew.w1, ew.w2, w, ids, w1_scale=ew.w1_scale, w2_scale=ew.w2_scale, **kwargs
        )  # fmt: skip

    return jax.jit(run)


def run_high_throughput(ctx, args, torch) -> None:
    n = ctx.num_processes
    x, w1, w2, scales, weights, ids = global_problem(
        tokens=n * args.ht_tokens, experts=args.experts, topk=args.topk, hidden=args.hidden,
        inter=args.inter, fp8=True, seed=11,
    )  # fmt: skip
    xr, ew, wr, idr, tok = local_slices(ctx, x, w1, w2, scales, weights, ids)
    problem = dl.DeepEPProblem(
        num_ranks=n, rank=ctx.process_id, num_experts=args.experts,
        num_tokens=args.ht_tokens, hidden=args.hidden, num_topk=args.topk,
    )  # fmt: skip
    buffer = dep_ht.make_high_throughput_buffer(ctx.group, problem)
    try:
        layer = ModularMoE(
            dep_ht.DeepEPHighThroughput(buffer=buffer, problem=problem), ContiguousExperts()
        )
        expert_map = expert_map_for_rank(args.experts, n, ctx.process_id)
        ep_layer = jitted_layer(layer, expert_map=expert_map)
        out = ep_layer(xr, ew, wr, idr)
        ref = fused_moe(x, w1, w2, weights, ids, **scales)[tok]
        check(ctx, "ht_vs_fused_moe", rel_error(out, ref), 5e-2)
        ht_gradient(ctx, layer, expert_map, (xr, ew, wr, idr), (x, w1, w2, scales, weights, ids))
        if args.quick:
            return
        # Dispatch + combine round trip: moe_jax (prepare + finalize, identity experts) vs direct.
        pf = layer.prepare_finalize
        qc = quant.Fp8BlockQuant()

        def ours_round_trip(x, w, ids):
            prepared = pf.prepare(x, w, ids, quant_config=qc, apply_router_weight_on_input=False)
            partial = dequant_rows(prepared.x, prepared.x_scales).astype(jnp.bfloat16)
            return pf.finalize(partial, prepared, _Unweighted(), out_dtype=jnp.bfloat16)

        ours = jax.jit(ours_round_trip)
        x_t = torch.from_dlpack(xr).clone()
        ids_t = torch.from_dlpack(idr).to(torch.int64)
        w_t = torch.from_dlpack(wr).clone()
        deep_ep = dep.import_deep_ep()
        cfg_d = deep_ep.Config(dep_ht.HT_NUM_SMS, *dep_ht.HT_DISPATCH_TUNING[n])
        cfg_c = deep_ep.Config(dep_ht.HT_NUM_SMS, *dep_ht.HT_COMBINE_TUNING[n])

        def direct():
            per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(
                ids_t, args.experts
            )
            recv, _, _, _, handle, _ = buffer.dispatch(
                x_t, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=ids_t,
                topk_weights=w_t, num_worst_tokens=n * args.ht_tokens, config=cfg_d,
            )  # fmt: skip
            combined, _, _ = buffer.combine(recv, handle, config=cfg_c)
            return combined

        direct_us = burst_us(direct, lambda _: torch.cuda.synchronize())
        ours_us = burst_us(lambda: ours(xr, wr, idr), jax.block_until_ready)
        layer_us = burst_us(lambda: ep_layer(xr, ew, wr, idr), jax.block_until_ready)
        single = jax.jit(lambda x, w, ids: fused_moe(x, w1, w2, w, ids, **scales))
        single_us = burst_us(lambda: single(xr, wr, idr), jax.block_until_ready)
        report(
            ctx, timing="ht", tokens_per_rank=args.ht_tokens, direct_round_trip_us=direct_us,
            moe_jax_round_trip_us=ours_us, speed_ratio=direct_us / ours_us,
            ep_layer_us=layer_us, single_gpu_layer_same_tokens_us=single_us,
            layer_vs_single_gpu=layer_us / single_us,
        )  # fmt: skip
    finally:
        buffer.destroy()


def ht_gradient(ctx, layer, expert_map, local, global_) -> None:
    """`jax.grad` through the DeepEP HT layer w.r.t. x and topk_weights (the FP8 weights are held
    constant) against `fused_moe`'s on the global batch; reported as refused (not a failure)
    while the adapter refuses (`gradient_refusal`: its torch callbacks define no VJP)."""
    (xr, ew, wr, idr), (x, w1, w2, scales, weights, ids) = local, global_
    tok = slice(ctx.process_id * len(xr), (ctx.process_id + 1) * len(xr))

    def probe():
        return jax.random.normal(jax.random.key(5), x.shape, jnp.float32)

    def ours(x, w):
        out = layer(x, ew.w1, ew.w2, w, idr, w1_scale=ew.w1_scale, w2_scale=ew.w2_scale,
                    expert_map=expert_map)  # fmt: skip
        return jnp.sum(out.astype(jnp.float32) * probe()[tok])

    def theirs(x, w):
        return jnp.sum(fused_moe(x, w1, w2, w, ids, **scales).astype(jnp.float32) * probe())

    try:
        grads = jax.jit(jax.grad(ours, argnums=(0, 1)))(xr, wr)
    except Exception as e:  # noqa: BLE001 (a missing VJP surfaces as the tracer's error)
        report(ctx, check="grad_deep_ep_ht", refused=f"{type(e).__name__}: {e}"[:600])
        return
    ref = jax.grad(theirs, (0, 1))(x, weights)
    for name, g, r in zip(("x", "topk_weights"), grads, ref, strict=True):
        check(ctx, f"grad_deep_ep_ht[{name}]", rel_error(g, r[tok]), 5e-2)


class _Unweighted:
    """Weight-and-reduce that sums nothing: the round trip's rows go back as they came."""

    def apply(self, expert_output, topk_weights, *, out_dtype):
        del topk_weights
        return expert_output.astype(out_dtype)


def run_low_latency(ctx, args, torch) -> None:
    n = ctx.num_processes
    x, w1, w2, scales, weights, ids = global_problem(
        tokens=n * args.ll_tokens, experts=args.experts, topk=args.topk, hidden=args.hidden,
        inter=args.inter, fp8=True, seed=12,
    )  # fmt: skip
    xr, ew, wr, idr, tok = local_slices(ctx, x, w1, w2, scales, weights, ids)
    problem = dl.DeepEPProblem(
        num_ranks=n, rank=ctx.process_id, num_experts=args.experts,
        num_tokens=args.ll_tokens, hidden=args.hidden, num_topk=args.topk,
    )  # fmt: skip
    buffer = dep_ll.make_low_latency_buffer(ctx.group, problem)
    try:
        ll = dep_ll.DeepEPLowLatency(buffer=buffer, problem=problem)
        layer = jitted_layer(ModularMoE(ll, MaskedExperts()))
        out = layer(xr, ew, wr, idr)
        ref = fused_moe(x, w1, w2, weights, ids, **scales)[tok]
        err = rel_error(out, ref)
        check(ctx, "ll_vs_fused_moe", err, 5e-2)
        if args.quick:
            return
        p = problem
        y = (
            jax.random.normal(jax.random.key(3), (p.num_local_experts, n * p.num_tokens, p.hidden))
            * 0.1
        ).astype(jnp.bfloat16)
        ours = jax.jit(lambda x, y, w, ids: ll.combine(y, ids, w, ll.dispatch(x, ids)))
        x_t, y_t = torch.from_dlpack(xr).clone(), torch.from_dlpack(y).clone()
        ids_t, w_t = torch.from_dlpack(idr).to(torch.int64), torch.from_dlpack(wr).clone()

        def direct():
            _, _, handle, _, _ = buffer.low_latency_dispatch(
                x_t, ids_t, p.num_tokens, p.num_experts, use_fp8=True
            )
            combined, _, _ = buffer.low_latency_combine(y_t, ids_t, w_t, handle)
            return combined

        direct_us = burst_us(direct, lambda _: torch.cuda.synchronize())
        ours_us = burst_us(lambda: ours(xr, y, wr, idr), jax.block_until_ready)
        layer_us = burst_us(lambda: layer(xr, ew, wr, idr), jax.block_until_ready)
        single = jax.jit(lambda x, w, ids: fused_moe(x, w1, w2, w, ids, **scales))
        single_us = burst_us(lambda: single(xr, wr, idr), jax.block_until_ready)
        report(
            ctx, timing="ll", tokens_per_rank=args.ll_tokens, direct_round_trip_us=direct_us,
            moe_jax_round_trip_us=ours_us, speed_ratio=direct_us / ours_us,
            ep_layer_us=layer_us, single_gpu_layer_same_tokens_us=single_us,
        )  # fmt: skip
        run_low_latency_graph(ctx, problem, buffer, (xr, ew, wr, idr, y), ref, direct_us)
    finally:
        buffer.destroy()


def run_low_latency_graph(ctx, problem, buffer, inputs, ref, direct_us) -> None:
    """The LL layer and round trip in command-buffer mode (XLA's CUDA graphs): checked against
    fused_moe like the eager adapter, then timed against the direct round trip above."""
    xr, ew, wr, idr, y = inputs
    ll = dep_ll.DeepEPLowLatency(buffer=buffer, problem=problem, command_buffer_compatible=True)
    ll.warm_up()  # collective: every rank
    layer = jitted_layer(ModularMoE(ll, MaskedExperts()))
    err = rel_error(layer(xr, ew, wr, idr), ref)
    check(ctx, "ll_graph_vs_fused_moe", err, 5e-2)
    ours = jax.jit(lambda x, y, w, ids: ll.combine(y, ids, w, ll.dispatch(x, ids)))
    calls_before = ll.capture.num_host_calls
    ours_us = burst_us(lambda: ours(xr, y, wr, idr), jax.block_until_ready)
    layer_us = burst_us(lambda: layer(xr, ew, wr, idr), jax.block_until_ready)
    report(
        ctx, timing="ll_graph", direct_round_trip_us=direct_us, moe_jax_round_trip_us=ours_us,
        speed_ratio=direct_us / ours_us,
        ep_layer_us=layer_us, host_calls_while_timing=ll.capture.num_host_calls - calls_before,
    )  # fmt: skip


def run_jax_native(ctx, args) -> None:
    """ep_fused_moe over a mesh of all processes' devices, "auto", "padded" and "ragged"
    transports; timed beside their all-to-all traffic alone and the one-device layer."""
    n = jax.device_count()
    x, w1, w2, _, weights, ids = global_problem(
        tokens=args.jax_tokens, experts=args.experts, topk=args.topk, hidden=args.jax_hidden,
        inter=args.jax_inter, fp8=False, seed=13,
    )  # fmt: skip
    mesh = jax.make_mesh((n,), ("ep",))
    ref = fused_moe(x, w1, w2, weights, ids)
    row = {}
    for transport in ("auto", "padded", "ragged"):
        if transport == "ragged" and jax.default_backend() == "cpu":
            report(ctx, check="jax_ep[ragged]", skipped="XLA:CPU has no ragged all-to-all")
            continue
        fn = jax.jit(
            lambda *a, transport=transport: ep_fused_moe(
                mesh, *a, axis_name="ep", transport=transport
            )[0]
        )
        check(ctx, f"jax_ep[{transport}]", local_error(fn(x, w1, w2, weights, ids), ref), 2e-2)
        if not args.quick:
            row[f"{transport}_layer_us"] = burst_us(
                lambda fn=fn: fn(x, w1, w2, weights, ids), jax.block_until_ready
            )
            if transport != "auto":
                row[f"{transport}_exchange_us"] = exchange_us(mesh, transport, ids, args)
    if args.quick:
        return
    per_rank = args.jax_tokens // n
    single = jax.jit(lambda x, w, ids: fused_moe(x, w1, w2, w, ids))
    row["single_gpu_layer_per_rank_tokens_us"] = burst_us(
        lambda: single(x[:per_rank], weights[:per_rank], ids[:per_rank]), jax.block_until_ready
    )
    auto = EPConfig(axis_name="ep").resolved_transport(x.dtype).name
    report(ctx, timing="jax", num_ranks=n, tokens_per_rank=per_rank, auto_resolves_to=auto, **row)


def exchange_us(mesh, transport, ids, args) -> float:
    """The JAX-native layer's all-to-all traffic alone under `transport`, as `ep_fused_moe` sends
    it at the default capacity C = T * k: the counts, bf16 rows [R * C, H] and int32 local ids
    to the experts' ranks, then the rows back."""
    n, spec = mesh.shape["ep"], jax.sharding.PartitionSpec("ep")
    exchange = TRANSPORTS.get(transport)
    capacity = args.jax_tokens // n * args.topk

    def local(rows, ids):
        _, _, routed = send_slots(ids, num_experts=args.experts, num_ranks=n, capacity=capacity)
        sent = jnp.minimum(routed, capacity)
        recv = jax.lax.all_to_all(sent, "ep", 0, 0, tiled=True)
        sizes = dict(axis_name="ep", num_ranks=n, capacity=capacity)
        there = exchange(rows, 0, send_sizes=sent, recv_sizes=recv, **sizes)
        local_ids = jnp.zeros(rows.shape[:1], jnp.int32) + jax.lax.axis_index("ep")
        local_ids = exchange(local_ids, -1, send_sizes=sent, recv_sizes=recv, **sizes)
        return exchange(there, 0, send_sizes=recv, recv_sizes=sent, **sizes), local_ids

    sharding = jax.sharding.NamedSharding(mesh, spec)
    shape = (n * n * capacity, args.jax_hidden)
    rows = jax.jit(lambda: jnp.ones(shape, jnp.bfloat16), out_shardings=sharding)()
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    ids = jax.device_put(ids, sharding)
    return burst_us(lambda: fn(rows, ids), jax.block_until_ready)


def run_grad(ctx, args) -> None:
    """`jax.grad` of sum(out * probe) through `ep_fused_moe` w.r.t. x, w1, w2 and topk_weights
    against single-device `fused_moe`'s on the global problem, float32 and bf16, both
    transports. On XLA:CPU the ragged transport's gradient is only lowered (no ragged
    all-to-all to run)."""
    mesh = jax.make_mesh((jax.device_count(),), ("ep",))
    x, w1, w2, _, weights, ids = global_problem(
        tokens=args.grad_tokens, experts=args.experts, topk=args.topk, hidden=args.jax_hidden,
        inter=args.jax_inter, fp8=False, seed=14,
    )  # fmt: skip

    def grads_of(layer):
        def loss(*a):
            out = layer(*a).astype(jnp.float32)
            return jnp.sum(out * jax.random.normal(jax.random.key(6), out.shape))

        return jax.jit(jax.grad(loss, (0, 1, 2, 3)))

    platform = jax.default_backend()
    for dtype in ("float32", "bfloat16"):
        inputs = (x.astype(dtype), w1.astype(dtype), w2.astype(dtype), weights)
        ref = grads_of(lambda *a: fused_moe(*a, ids))(*inputs)
        for transport in ("padded", "ragged"):
            name = f"grad_ep[{transport},{dtype}]"
            grad = grads_of(
                lambda *a, t=transport: ep_fused_moe(mesh, *a, ids, axis_name="ep", transport=t)[0]
            )
            if transport == "ragged" and platform == "cpu":
                ok = "ragged_all_to_all" in grad.lower(*inputs).as_text()
                report(ctx, check=name, skipped="XLA:CPU has no ragged all-to-all", lowered=ok)
                if not ok:
                    FAILURES.append(name)
                continue
            grads = grad(*inputs)
            for arg, g, r in zip(("x", "w1", "w2", "topk_weights"), grads, ref, strict=True):
                check(ctx, f"{name}[{arg}]", local_error(g, r), GRAD_RTOL[dtype][platform])


def print_targets(ctx) -> None:
    """Rank 0's verdict on issue 64's targets from its timing rows: one JSON line per target,
    its "line" the times (us), the ratio, the bound and PASS, MISS or NOT MEASURED."""
    if ctx.process_id:
        return

    def show(v):
        return "n/a" if v is None else f"{v:.4g}"

    targets, jax_row = [], TIMINGS.get("jax", {})  # (name, ratio, bound, at least or at most)
    for mode in ("ht", "ll", "ll_graph"):
        row = TIMINGS.get(mode, {})
        direct, ours = row.get("direct_round_trip_us"), row.get("moe_jax_round_trip_us")
        name = f"deep_ep_{mode} dispatch+combine direct / moe_jax = {show(direct)} / {show(ours)}"
        targets.append((name, row.get("speed_ratio"), 0.95, 1))
    single = jax_row.get("single_gpu_layer_per_rank_tokens_us")
    for transport in ("padded", "ragged"):
        layer, exch = (jax_row.get(f"{transport}_{t}_us") for t in ("layer", "exchange"))
        ratio = None if None in (layer, exch, single) else layer / (single + exch)
        name = f"jax_ep[{transport}] on {jax_row.get('num_ranks')} ranks (target set on 2): layer"
        name += (
            f" / (one-device layer + exchange) = {show(layer)} / ({show(single)} + {show(exch)})"
        )
        targets.append((name, ratio, 1.3, -1))
    for name, ratio, bound, sign in targets:
        verdict = "PASS" if ratio is not None and sign * (ratio - bound) >= 0 else "MISS"
        verdict = "NOT MEASURED" if ratio is None else verdict
        line = f"{name} = {show(ratio)} {'>=' if sign > 0 else '<='} {bound} {verdict}"
        report(ctx, target=name, verdict=verdict, ratio=ratio, line=line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    distributed.add_arguments(parser)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--ht-tokens", type=int, default=4096, help="per rank")
    parser.add_argument("--ll-tokens", type=int, default=128, help="per rank")
    parser.add_argument("--jax-tokens", type=int, default=4096, help="all ranks together")
    parser.add_argument("--jax-hidden", type=int, default=2048)
    parser.add_argument("--jax-inter", type=int, default=768)
    parser.add_argument("--grad-tokens", type=int, default=1024, help="all ranks together")
    parser.add_argument("--quick", action="store_true", help="checks only, no timing")
    parser.add_argument("--parts", default="ht,ll,jax,grad")
    parser.add_argument("--hang-timeout-s", type=float, default=300)
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.hang_timeout_s, exit=True)
    ctx = distributed.init_from_args(args)
    import torch

    report(ctx, devices=str(jax.devices()), local=str(jax.local_devices()), jax=jax.__version__)
    steps = {
        "ht": lambda: run_high_throughput(ctx, args, torch),
        "ll": lambda: run_low_latency(ctx, args, torch),
        "jax": lambda: run_jax_native(ctx, args),
        "grad": lambda: run_grad(ctx, args),
    }
    try:
        for name in args.parts.split(","):
            try:
                steps[name]()
            except Exception:
                traceback.print_exc()
                FAILURES.append(name)
            torch.distributed.barrier(group=ctx.group)
        print_targets(ctx)
    finally:
        distributed.shutdown_distributed()
    report(ctx, failures=FAILURES)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
