"""Expert parallelism on 2 (4, 8) GPUs: DeepEP high-throughput and low-latency through moe_jax, and
the JAX-native all-to-all EP, each checked against single-device `fused_moe` on the same global
problem and timed against direct DeepEP calls / the single-GPU layer; the low-latency layer and
round trip also in command-buffer mode (`DeepEPLowLatency(command_buffer_compatible=True)`).

Run on a host with R GPUs (after `source .gpu/install.sh`):

    python -m moe_jax.distributed --num-processes 2 scripts/ep_multigpu.py [--quick]

Every process builds the same global inputs from one seed, keeps its T tokens and E / R experts
(rank r owns experts [r * E / R, (r + 1) * E / R)), and computes the global `fused_moe` itself
for the check. Prints JSON lines (rank 0 prints the timings); exit status 1 if a check failed.
Timing: medians over samples of bursts, one device sync per burst (METHOD.md).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import ContiguousExperts, MaskedExperts, ModularMoE, distributed, fused_moe, quant
from moe_jax.cli.timing import time_calls
from moe_jax.ep_api import ep_fused_moe
from moe_jax.expert_parallel import expert_map_for_rank
from moe_jax.experts import ExpertWeights
from moe_jax.grouped_gemm import dequant_rows
from moe_jax.interop import deep_ep as dep
from moe_jax.interop import deep_ep_ht as dep_ht
from moe_jax.interop import deep_ep_layouts as dl
from moe_jax.interop import deep_ep_ll as dep_ll

FAILURES: list[str] = []


def report(ctx, **row) -> None:
    print(json.dumps({"rank": ctx.process_id, **row}), flush=True)


def global_problem(*, tokens, experts, topk, hidden, inter, fp8, seed):
    """Identical on every rank: (x [R*T, H], w1, w2 (, scales), weights, ids) as NumPy/JAX."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(experts)[:topk] for _ in range(tokens)]).astype(np.int32)
    logits = rng.standard_normal((tokens, topk))
    weights = (np.exp(logits) / np.exp(logits).sum(1, keepdims=True)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((experts, 2 * inter, hidden)) / np.sqrt(hidden))
    w2 = jnp.asarray(rng.standard_normal((experts, hidden, inter)) / np.sqrt(inter))
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
        err = rel_error(out, ref)
        report(ctx, check="ht_vs_fused_moe", rel_error=err, ok=err < 5e-2)
        if not err < 5e-2:
            FAILURES.append("ht_vs_fused_moe")
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
        )  # fmt: skip
    finally:
        buffer.destroy()


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
        report(ctx, check="ll_vs_fused_moe", rel_error=err, ok=err < 5e-2)
        if not err < 5e-2:
            FAILURES.append("ll_vs_fused_moe")
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
    report(ctx, check="ll_graph_vs_fused_moe", rel_error=err, ok=err < 5e-2)
    if not err < 5e-2:
        FAILURES.append("ll_graph_vs_fused_moe")
    ours = jax.jit(lambda x, y, w, ids: ll.combine(y, ids, w, ll.dispatch(x, ids)))
    calls_before = ll.capture.num_host_calls
    ours_us = burst_us(lambda: ours(xr, y, wr, idr), jax.block_until_ready)
    layer_us = burst_us(lambda: layer(xr, ew, wr, idr), jax.block_until_ready)
    report(
        ctx, timing="ll_graph", moe_jax_round_trip_us=ours_us, speed_ratio=direct_us / ours_us,
        ep_layer_us=layer_us, host_calls_while_timing=ll.capture.num_host_calls - calls_before,
    )  # fmt: skip


def run_jax_native(ctx, args) -> None:
    """ep_fused_moe over a mesh of all processes' GPUs, "padded" and "ragged" transports."""
    n = ctx.num_processes
    x, w1, w2, _, weights, ids = global_problem(
        tokens=args.jax_tokens, experts=args.experts, topk=args.topk, hidden=args.jax_hidden,
        inter=args.jax_inter, fp8=False, seed=13,
    )  # fmt: skip
    mesh = jax.make_mesh((n,), ("ep",))
    ref = fused_moe(x, w1, w2, weights, ids)
    per_rank = args.jax_tokens // n
    tok = slice(ctx.process_id * per_rank, (ctx.process_id + 1) * per_rank)
    for transport in ("auto", "padded", "ragged"):
        fn = jax.jit(
            lambda *a, transport=transport: ep_fused_moe(
                mesh, *a, axis_name="ep", transport=transport
            )[0]
        )
        out = fn(x, w1, w2, weights, ids)
        local = np.concatenate([np.asarray(s.data) for s in out.addressable_shards])
        err = rel_error(local, ref[tok])
        us = burst_us(lambda fn=fn: fn(x, w1, w2, weights, ids), jax.block_until_ready)
        report(ctx, check=f"jax_ep[{transport}]", rel_error=err, ok=err < 2e-2, layer_us=us)
        if not err < 2e-2:
            FAILURES.append(f"jax_ep[{transport}]")
    single = jax.jit(lambda x, w, ids: fused_moe(x, w1, w2, w, ids))
    report(
        ctx, timing="jax_single_gpu_same_tokens",
        layer_us=burst_us(lambda: single(x[tok], weights[tok], ids[tok]), jax.block_until_ready),
    )  # fmt: skip


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
    parser.add_argument("--quick", action="store_true", help="checks only, no timing")
    parser.add_argument("--parts", default="ht,ll,jax")
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
    }
    try:
        for name in args.parts.split(","):
            try:
                steps[name]()
            except Exception:
                traceback.print_exc()
                FAILURES.append(name)
            torch.distributed.barrier(group=ctx.group)
    finally:
        distributed.shutdown_distributed()
    report(ctx, failures=FAILURES)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
