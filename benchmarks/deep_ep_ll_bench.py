"""DeepEP low-latency through moe_jax on one GPU: correctness against fused_moe and direct DeepEP,
then dispatch/combine time through moe_jax against direct DeepEP calls in the same process.

Run (after `source .gpu/install.sh` on the H200 host):

    python -m moe_jax.distributed --num-processes 1 benchmarks/deep_ep_ll_bench.py [--quick]

World size 1: every expert is local, DeepEP's "sends" stay on the GPU (NVSHMEM P2P to itself).
Prints one JSON line per measurement and a summary table; exits non-zero when a check fails.

Timing (METHOD.md): dispatch -> combine round trips chained through their data (the combine's
output is the next dispatch's input), medians over samples: a burst of N round trips (moe_jax:
one jitted program of N chained calls; direct: a Python loop), one device sync, divided by N,
for each receive copy (`recv_copy`).

Command-buffer mode (`--graph`, run with XLA_FLAGS letting XLA capture custom calls, e.g.
`--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN
--xla_gpu_graph_min_graph_size=1`): the same chained round trips through
`DeepEPLowLatency(command_buffer_compatible=True)`, checked against the eager adapter's output
(including calls on fresh input buffers, which XLA re-captures), with the number of DeepEP calls
Python made while timing (0 when XLA replays its graphs), against the direct chain captured in a
torch CUDA graph and replayed; and the whole LL layer (`ll_layer`) in that mode. The bridge's own
host cost (a jitted no-op `torch_callback`) is BENCHMARKS.md's Interop figure.

Graph-mode timings also report a steady state per round trip: each sample times 5 and then 20
chains back to back, and the difference over the extra chains drops the sample's fixed lead-in
(the first chain's launch, the final wait), which a loop of many decode steps pays once.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import os
import statistics
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import MaskedExperts, ModularMoE, distributed, fused_moe, quant
from moe_jax.cli.timing import time_calls
from moe_jax.experts import ExpertWeights
from moe_jax.interop import deep_ep as dep
from moe_jax.interop import deep_ep_layouts as dl
from moe_jax.interop import deep_ep_ll as dep_ll

FAILURES: list[str] = []
STREAMED_CALLS = 5  # back-to-back chains per streamed sample of the graph-mode comparison
# Steady state: a sample of STEADY_FACTOR * STREAMED_CALLS chains minus one of STREAMED_CALLS
# chains cancels the fixed lead-in of a sample (the first chain's launch, the final wait), which a
# decode loop of many steps pays once.
STEADY_FACTOR = 4


def report(**row) -> None:
    print(json.dumps(row), flush=True)


def check(name: str, ok: bool, **details) -> None:
    report(check=name, ok=bool(ok), **details)
    if not ok:
        FAILURES.append(name)


def make_problem(args, seed: int):
    rng = np.random.default_rng(seed)
    t, e, k, h, i = args.tokens, args.experts, args.topk, args.hidden, args.inter
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    logits = rng.standard_normal((t, k))
    weights = (np.exp(logits) / np.exp(logits).sum(1, keepdims=True)).astype(np.float32)
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    x = jax.random.normal(k1, (t, h), jnp.float32).astype(jnp.bfloat16)
    w1 = jax.random.normal(k2, (e, 2 * i, h), jnp.float32) / np.sqrt(h)
    w2 = jax.random.normal(k3, (e, h, i), jnp.float32) / np.sqrt(i)
    w1, w1_scale = quant.per_block_quant_fp8(w1)
    w2, w2_scale = quant.per_block_quant_fp8(w2)
    expert_weights = ExpertWeights(w1=w1, w2=w2, w1_scale=w1_scale, w2_scale=w2_scale)
    return x, expert_weights, jnp.asarray(weights), jnp.asarray(ids)


def rel_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def ll_layer(ll, gemm: str = "auto"):
    """`ModularMoE(ll, MaskedExperts(gemm=gemm))` under jax.jit on (x, ExpertWeights, tw, ids)."""
    layer = ModularMoE(ll, MaskedExperts(gemm=gemm))
    return jax.jit(
        lambda x, w, tw, ids: layer(
            x, w.w1, w.w2, tw, ids, w1_scale=w.w1_scale, w2_scale=w.w2_scale
        )
    )


def check_layer(args, ll, torch) -> None:
    """The LL layer == fused_moe (same FP8 weights) on fresh inputs."""
    for seed in (1, 2):
        x, w, tw, ids = make_problem(args, seed)
        out = ll_layer(ll)(x, w, tw, ids)
        ref = fused_moe(x, w.w1, w.w2, tw, ids, w1_scale=w.w1_scale, w2_scale=w.w2_scale)
        err = rel_error(out, ref)
        # Two FP8 casts of the same bf16 rows (DeepEP's amax floor 1e-4 vs moe_jax's) and DeepEP's
        # bf16 combine: measured relative error well under vLLM's DeepGEMM bound of 5e-2.
        check("ll_moe_vs_fused_moe", err < 5e-2 and np.isfinite(err), seed=seed, rel_error=err)


def check_dispatch_against_direct(args, ll, buffer, torch) -> None:
    """Valid received rows, scales and counts through moe_jax == a direct DeepEP dispatch."""
    x, _, _, ids = make_problem(args, 3)
    got = jax.block_until_ready(jax.jit(ll.dispatch)(x, ids))  # one LL call in flight at a time
    x_t = torch.from_dlpack(x)
    ids_t = torch.from_dlpack(ids).to(torch.int64)
    (rows, scales), count, handle, _, _ = buffer.low_latency_dispatch(
        x_t, ids_t, ll.problem.num_tokens, ll.problem.num_experts, use_fp8=True
    )
    torch.cuda.synchronize()
    count = count.cpu().numpy()
    check("dispatch_counts", (np.asarray(got.recv_count) == count).all())
    # Row order within an expert follows DeepEP's atomics: compare rows keyed by source token.
    ours_rows = np.asarray(got.rows.view(jnp.uint8))
    ours_scales = np.asarray(dl.ll_scales_from_storage(got.scales_storage))
    ours_src = np.asarray(got.handle.src_info)
    ref_rows = rows.view(torch.uint8).cpu().numpy()
    ref_scales = scales.float().cpu().numpy()
    ref_src = handle[0].cpu().numpy()
    same = True
    for e in range(len(count)):
        n = count[e]
        a, b = np.argsort(ours_src[e, :n]), np.argsort(ref_src[e, :n])
        same &= (ours_src[e, :n][a] == ref_src[e, :n][b]).all()
        same &= (ours_rows[e, :n][a] == ref_rows[e, :n][b]).all()
        same &= (ours_scales[e, :n][a] == ref_scales[e, :n][b]).all()
    check("dispatch_valid_rows_equal_direct", same, rows=int(count.sum()))


def time_round_trips(args, ll, torch) -> dict:
    """Wall time per round trip of chained dispatch -> combine (module docstring)."""
    p, n = ll.problem, args.burst
    x, _, tw, ids = make_problem(args, 4)
    y = jax.random.normal(jax.random.key(5), (p.num_local_experts, p.num_tokens, p.hidden))
    y = (y * 0.1).astype(jnp.bfloat16)
    ours = jax.jit(functools.partial(_chain_with, ll, n))
    x_t, y_t = torch.from_dlpack(x).clone(), torch.from_dlpack(y).clone()
    tw_t, ids_t = torch.from_dlpack(tw).clone(), torch.from_dlpack(ids).to(torch.int64)

    def direct(x_t):
        for _ in range(n):
            _, _, handle, _, _ = ll.buffer.low_latency_dispatch(
                x_t, ids_t, p.num_tokens, p.num_experts, use_fp8=True
            )
            x_t, _, _ = ll.buffer.low_latency_combine(y_t, ids_t, tw_t, handle)
        return x_t

    def wall(fn, sync):  # us per round trip: each sample is one waited-for chain of n
        return time_calls(fn, wait=sync, samples=args.samples, burst=1).streamed_ms * 1e3 / n

    return {
        "direct_wall_us": wall(lambda: direct(x_t), lambda _: torch.cuda.synchronize()),
        "moe_jax_wall_us": wall(lambda: ours(x, y, tw, ids), jax.block_until_ready),
    }


def _identity_round_trip(ll, x, tw, ids):
    """dispatch -> each expert returns its received row (dequantized) -> combine: sum_k w_k x_t up
    to FP8, the same bits whatever order DeepEP's atomics gave the rows."""
    got = ll.dispatch(x, ids)
    scales = dl.ll_scales_from_storage(got.scales_storage)
    rows = got.rows.astype(jnp.float32).reshape(*scales.shape, -1) * scales[..., None]
    valid = jnp.arange(rows.shape[1])[None, :] < got.recv_count[:, None]  # stale rows -> 0
    rows = jnp.where(valid[..., None], rows.reshape(got.rows.shape), 0.0)
    return ll.combine(rows.astype(jnp.bfloat16), ids, tw, got)


def time_graph_round_trips(args, problem, buffer, torch) -> dict:
    """Round trips through the command-buffer adapter against direct DeepEP, eager and in a
    torch CUDA graph, in one process."""
    p = problem
    eager = dep_ll.DeepEPLowLatency(buffer=buffer, problem=p)
    ll = dep_ll.DeepEPLowLatency(buffer=buffer, problem=p, command_buffer_compatible=True)
    ll.warm_up()
    n = args.burst
    # Correct first: equal to the eager adapter, also on fresh input buffers (XLA re-captures).
    _, _, tw, ids = make_problem(args, 4)
    ours_once = jax.jit(functools.partial(_identity_round_trip, ll))
    eager_once = jax.jit(functools.partial(_identity_round_trip, eager))
    worst, worst_ref = 0.0, 0.0
    for seed in (4, 7, 8):
        xs = make_problem(args, seed)[0]
        got = np.asarray(jax.block_until_ready(ours_once(xs, tw, ids)), np.float64)
        want = np.asarray(jax.block_until_ready(eager_once(xs, tw, ids)), np.float64)
        worst = max(worst, float(np.abs(got - want).max()))
        expected = np.einsum("tk,th->th", np.asarray(tw, np.float64), np.asarray(xs, np.float64))
        worst_ref = max(worst_ref, rel_error(got, expected))
    check("graph_round_trip_equals_eager", worst == 0.0, max_abs_difference=worst)
    check("graph_round_trip_vs_sum_of_weights_x", worst_ref < 5e-2, rel_error=worst_ref)

    x, _, tw, ids = make_problem(args, 4)
    y = jax.random.normal(jax.random.key(5), (p.num_local_experts, p.num_tokens, p.hidden))
    y = (y * 0.1).astype(jnp.bfloat16)
    ours = jax.jit(functools.partial(_chain_with, ll, n))
    calls_before = ll.capture.num_host_calls
    results = {
        "moe_jax_graph_wall_us": time_calls(
            lambda: ours(x, y, tw, ids), wait=jax.block_until_ready, samples=args.samples, burst=1
        ).streamed_ms
        * 1e3
        / n,
        "host_calls_while_timing": ll.capture.num_host_calls - calls_before,
    }
    # Direct DeepEP: the same chain eager, and captured once in a torch CUDA graph (as vLLM runs
    # decode steps).
    x_t, y_t = torch.from_dlpack(x).clone(), torch.from_dlpack(y).clone()
    tw_t, ids_t = torch.from_dlpack(tw).clone(), torch.from_dlpack(ids).to(torch.int64)

    def direct_chain():
        out = x_t
        for _ in range(n):
            _, _, handle, _, _ = buffer.low_latency_dispatch(
                out, ids_t, p.num_tokens, p.num_experts, use_fp8=True
            )
            out, _, _ = buffer.low_latency_combine(y_t, ids_t, tw_t, handle)
        return out

    def wall(fn):
        timing = time_calls(
            fn, wait=lambda _: torch.cuda.synchronize(), samples=args.samples, burst=1
        )
        return timing.streamed_ms * 1e3 / n

    def streamed(fn, wait):
        timing = time_calls(fn, wait=wait, samples=args.samples, burst=STREAMED_CALLS)
        return timing.streamed_ms * 1e3 / n

    results["direct_wall_us"] = wall(direct_chain)
    # Streamed: STREAMED_CALLS chains back to back, one wait (as a decode loop enqueues its next
    # step while one runs): the host's per-call launch work overlaps the device's. Steady: the
    # per-round-trip cost once a sample's fixed lead-in is subtracted (STEADY_FACTOR's comment).
    # The two chains alternate, so a drift of the machine's clocks hits both alike.
    for _ in range(2):
        for name, fn, wait in (
            ("moe_jax_graph", lambda: ours(x, y, tw, ids), jax.block_until_ready),
            ("direct", direct_chain, lambda _: torch.cuda.synchronize()),
        ):
            short, long = steady_streamed(fn, wait, args.samples, n)
            results.setdefault(f"{name}_streamed_us", []).append(short)
            results.setdefault(f"{name}_steady_us", []).append(long)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        direct_chain()  # warm-up off the capture, as torch's graph docs ask
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        direct_chain()
    results["direct_graph_wall_us"] = wall(graph.replay)
    results["direct_graph_streamed_us"] = streamed(graph.replay, lambda _: torch.cuda.synchronize())
    del graph
    return results


def steady_streamed(fn, wait, samples: int, round_trips: int) -> tuple[float, float]:
    """(streamed, steady) us per round trip of `fn` (a chain of `round_trips`): streamed is the
    median over samples of STREAMED_CALLS back-to-back chains and one wait; steady takes each
    sample's time for STEADY_FACTOR times as many chains, subtracts the short sample's, and
    divides by the extra round trips (median of per-sample differences)."""
    short_calls, long_calls = STREAMED_CALLS, STREAMED_CALLS * STEADY_FACTOR
    shorts, steadies = [], []
    for _ in range(samples):
        t_short = time_calls(fn, wait=wait, samples=1, burst=short_calls).streamed_ms * short_calls
        t_long = time_calls(fn, wait=wait, samples=1, burst=long_calls).streamed_ms * long_calls
        shorts.append(t_short * 1e3 / (short_calls * round_trips))
        steadies.append((t_long - t_short) * 1e3 / ((long_calls - short_calls) * round_trips))
    return statistics.median(shorts), statistics.median(steadies)


def time_graph_layer(args, problem, buffer) -> dict:
    """The LL layer in command-buffer mode with DeepGEMM's masked GEMM, the Pallas grouped
    GEMM on the masked layout, and "auto" (the GEMM registry's choice, which it reports): each
    checked against fused_moe, then timed."""
    from moe_jax.cli.timing import time_jax

    ll = dep_ll.DeepEPLowLatency(buffer=buffer, problem=problem, command_buffer_compatible=True)
    ll.warm_up()
    x, w, tw, ids = make_problem(args, 6)
    ref = fused_moe(x, w.w1, w.w2, tw, ids, w1_scale=w.w1_scale, w2_scale=w.w2_scale)
    from moe_jax import grouped_gemm

    p = problem
    chosen = grouped_gemm.GEMMS.select(
        "auto",
        grouped_gemm.GemmProblem(
            platform="gpu",
            layout="masked",
            x_dtype="float8_e4m3fn",
            w_dtype="float8_e4m3fn",
            num_experts=p.num_local_experts,
            num_pairs=p.num_ranks * p.num_tokens * p.num_topk,
            n=w.w1.shape[1],
            k=p.hidden,
            max_m=p.num_ranks * p.num_tokens,
        ),
    )
    results = {"auto_gemm": chosen.name}
    for gemm in ("deep_gemm", "pallas", "auto"):
        layer = ll_layer(ll, gemm)
        err = rel_error(layer(x, w, tw, ids), ref)
        check(f"graph_ll_moe_vs_fused_moe[{gemm}]", err < 5e-2 and np.isfinite(err), rel_error=err)
        calls_before = ll.capture.num_host_calls
        ms, latency_ms = time_jax(layer, (x, w, tw, ids), iters=args.samples)
        results[f"graph_ll_layer_{gemm}_us"] = ms * 1e3
        results[f"graph_ll_layer_{gemm}_latency_us"] = latency_ms * 1e3
        results[f"host_calls_while_timing_{gemm}"] = ll.capture.num_host_calls - calls_before
    single = jax.jit(
        lambda x, w, tw, ids: fused_moe(
            x, w.w1, w.w2, tw, ids, w1_scale=w.w1_scale, w2_scale=w.w2_scale
        )
    )
    results["fused_moe_us"] = time_jax(single, (x, w, tw, ids), iters=args.samples)[0] * 1e3
    return results


def _chain_with(ll, n, x, y, tw, ids):
    for _ in range(n):
        x = ll.combine(y, ids, tw, ll.dispatch(x, ids))
    return x


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    distributed.add_arguments(parser)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--burst", type=int, default=20)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="checks only, no timing")
    parser.add_argument(
        "--graph", action="store_true", help="also the command-buffer mode (module docstring)"
    )
    parser.add_argument(
        "--skip-eager-timing", action="store_true", help="checks, and graph timings with --graph"
    )
    parser.add_argument("--hang-timeout-s", type=float, default=240)
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.hang_timeout_s, exit=True)  # a hung collective
    ctx = distributed.init_from_args(args)
    import torch

    problem = dl.DeepEPProblem(
        num_ranks=ctx.num_processes,
        rank=ctx.process_id,
        num_experts=args.experts,
        num_tokens=args.tokens,
        hidden=args.hidden,
        num_topk=args.topk,
    )
    buffer = dep_ll.make_low_latency_buffer(ctx.group, problem)
    report(
        devices=str(jax.devices()),
        jax=jax.__version__,
        torch=torch.__version__,
        problem=str(problem),
        topk_idx_t=str(getattr(dep.import_deep_ep(), "topk_idx_t", None)),
    )
    try:
        ll = dep_ll.DeepEPLowLatency(buffer=buffer, problem=problem)
        steps = [
            ("dispatch_vs_direct", lambda: check_dispatch_against_direct(args, ll, buffer, torch)),
            ("layer_vs_fused_moe", lambda: check_layer(args, ll, torch)),
        ]
        if not (args.quick or args.skip_eager_timing):
            for copy in ("valid_rows", "all_rows"):
                timed = dep_ll.DeepEPLowLatency(buffer=buffer, problem=problem, recv_copy=copy)
                steps.append(
                    (
                        f"round_trips[{copy}]",
                        lambda timed=timed, copy=copy: report(
                            timing="round_trip",
                            recv_copy=copy,
                            burst=args.burst,
                            **time_round_trips(args, timed, torch),
                        ),
                    )
                )
        if args.graph and not args.quick:
            steps.append(
                (
                    "graph_round_trips",
                    lambda: report(
                        timing="graph_round_trip",
                        burst=args.burst,
                        xla_flags=os.environ.get("XLA_FLAGS", ""),
                        **time_graph_round_trips(args, problem, buffer, torch),
                    ),
                )
            )
            steps.append(
                (
                    "graph_layer",
                    lambda: report(timing="graph_layer", **time_graph_layer(args, problem, buffer)),
                )
            )
        for name, step in steps:
            try:
                step()
            except Exception:  # report and go on: one GPU call has to bring back every answer
                traceback.print_exc()
                FAILURES.append(name)
    finally:
        buffer.destroy()
        distributed.shutdown_distributed()
    report(failures=FAILURES)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    # `moe_jax.distributed` runs this as a file: the checkout's root goes on sys.path so that
    # the tools beside it import as `benchmarks.*`.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
