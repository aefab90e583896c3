"""Times the contiguous layout's rank methods (`moe_jax.layouts.contiguous_destinations`), or
with `--metadata` the whole routing metadata: XLA against the one Pallas kernel.

For each shape, every candidate computes the whole of `contiguous_destinations` (inverse,
counts, ends; alignment 128) with one rank method: "current" (the code before the blocked
rank: pairwise up to 512 pairs, one-hot cumsum above), "auto" (`expert_rank.method_for`'s choice),
"pairwise" (up to 16384 pairs), "cumsum", "blocked" at several block sizes and with the block
prefix by cumsum ("prefix=cumsum"), and "sorted". Each is first checked bit for bit against
"current" on the routing timed (k distinct experts per token, all valid) and on one with ids
out of range and repeated experts; "current" itself against a NumPy stable-argsort oracle.
The command exits 1 on any mismatch.

`--metadata` times `moe_jax.layouts.routing_metadata` ("xla": the destinations above with
`expert_rank.method_for`'s rank, plus the scatter of each row's token and expert) against
`moe_jax.kernels.routing_metadata` (the one Pallas kernel) at its heuristic and a few other
block sizes, each first checked bit for bit against "xla" on both routings.

Timing: host clock (`moe_jax.cli.timing.time_calls`: median of `--samples` samples of
`--burst` back-to-back jitted calls, waited for with `jax.block_until_ready`), and, on a GPU,
device time from a `jax.profiler` trace of `--trace-samples` bursts (`benchmarks.kernel_gaps`'
reader): the summed kernel time per call and the kernels per call.

    python -m benchmarks.destinations_bench [--shapes A B decode_128] [--json out.jsonl]
    python -m benchmarks.destinations_bench --shapes decode_8 --samples 2 --burst 2  # CPU smoke
    python -m benchmarks.destinations_bench --metadata [--shapes A B]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kernel_gaps
from moe_jax import expert_rank, layouts
from moe_jax.cli import timing
from moe_jax.kernels import routing_metadata as metadata_kernel
from moe_jax.kernels.routing_metadata import heuristic_config as metadata_heuristic

ALIGNMENT = layouts.DEFAULT_ALIGNMENT
PREVIOUS_PAIRWISE_MAX_PAIRS = 512  # "current": the rule before the blocked rank (cumsum above)
PAIRWISE_MAX_PAIRS = 16384  # "pairwise" is timed up to here; beyond, its [P, P] compare is moot


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    num_tokens: int
    topk: int
    num_experts: int

    @property
    def num_pairs(self) -> int:
        return self.num_tokens * self.topk


SHAPES = {
    s.name: s
    for s in [
        Shape("A", 4096, 8, 32),  # `bench` shape A
        Shape("B", 8192, 8, 128),  # `bench` shape B
        # `bench --decode` token counts, DeepSeek-V3 experts on one GPU
        *(Shape(f"decode_{t}", t, 8, 256) for t in (1, 8, 32, 128, 512, 2048)),
    ]
}


def candidates(shape: Shape) -> dict[str, Callable]:
    """Name -> ranker (`expert_rank.RANKERS` values, some with tunables bound)."""
    old = "pairwise" if shape.num_pairs <= PREVIOUS_PAIRWISE_MAX_PAIRS else "cumsum"
    out = {
        f"current ({old})": expert_rank.RANKERS[old],
        f"auto ({expert_rank.method_for(shape.num_pairs)})": expert_rank.RANKERS[
            expert_rank.method_for(shape.num_pairs)
        ],
    }
    if shape.num_pairs <= PAIRWISE_MAX_PAIRS:
        out["pairwise"] = expert_rank.rank_pairwise
    out["cumsum"] = expert_rank.rank_cumsum
    for block in (128, 256, 512, 1024):
        out[f"blocked B={block}"] = functools.partial(expert_rank.rank_blocked, block=block)
    out[f"blocked B={expert_rank.BLOCK} prefix=cumsum"] = functools.partial(
        expert_rank.rank_blocked, block=expert_rank.BLOCK, triangular_max_blocks=0
    )
    out["sorted"] = expert_rank.rank_sorted
    return out


def metadata_candidates(shape: Shape, interpret: bool) -> dict[str, Callable]:
    """Name -> f(local_ids) -> RoutingMetadata: "xla" first, then the Pallas kernel."""
    num_rows = layouts.contiguous_num_rows(
        shape.num_tokens, shape.topk, shape.num_experts, ALIGNMENT
    )
    kwargs = dict(num_experts=shape.num_experts, alignment=ALIGNMENT, num_rows=num_rows)
    out = {"xla": functools.partial(layouts.routing_metadata, **kwargs)}
    base = metadata_heuristic(shape.num_pairs, shape.num_experts)
    configs = {"pallas heuristic": base}
    for change in (
        dict(block_p=base.block_p * 2),
        dict(block_c=base.block_c * 2),
        dict(block_c=max(base.block_p, base.block_c // 2)),
        dict(num_warps=8),
    ):
        try:
            config = dataclasses.replace(base, **change)
        except ValueError:  # e.g. steps longer than the chunk at a small P
            continue
        if config != base:
            configs["pallas " + " ".join(f"{k}={v}" for k, v in change.items())] = config
    for name, config in configs.items():
        out[name] = functools.partial(
            metadata_kernel.routing_metadata, **kwargs, config=config, interpret=interpret
        )
    return out


def routings(shape: Shape, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(timed ids: k distinct experts per token, as a router's top-k; checked-only ids: out of
    range on both sides, the first two slots of every third token on one expert)."""
    rng = np.random.default_rng(seed)
    scores = rng.random((shape.num_tokens, shape.num_experts))
    timed = np.argsort(scores, axis=1)[:, : shape.topk].astype(np.int32)
    awkward = rng.integers(-1, shape.num_experts + 2, size=(shape.num_tokens, shape.topk))
    if shape.topk > 1:
        awkward[::3, 1] = awkward[::3, 0]
    return timed, awkward.astype(np.int32)


def numpy_destinations(ids: np.ndarray, num_experts: int, alignment: int):
    """(inverse, counts, ends) by a stable argsort: an oracle for "current"."""
    flat = ids.reshape(-1)
    is_valid = (flat >= 0) & (flat < num_experts)
    counts = np.bincount(flat[is_valid], minlength=num_experts)
    padded = -(-counts // alignment) * alignment
    ends = np.cumsum(padded)
    order = np.argsort(np.where(is_valid, flat, num_experts), kind="stable")
    position = np.empty_like(order)
    position[order] = np.arange(flat.size)
    first = np.cumsum(counts) - counts
    expert = np.clip(flat, 0, num_experts - 1)
    dest = (ends - padded)[expert] + position - first[expert]
    return np.where(is_valid, dest, -1).reshape(ids.shape), counts, ends


def device_time(fn: Callable, ids: jax.Array, samples: int, burst: int) -> dict:
    """Summed kernel time (us) and kernel count per call, from a `jax.profiler` trace of
    `samples` bursts of `burst` calls (plus `timing.WARMUP` calls), and the three longest
    kernels (us per call)."""
    with tempfile.TemporaryDirectory() as trace_dir:
        path, *_ = kernel_gaps._trace(fn, (ids,), samples, burst, trace_dir)
        events, where = kernel_gaps.device_kernels(path)
    calls = timing.WARMUP + samples * burst
    if not events:
        return dict(device_us=None, note=where)
    by_name: dict[str, float] = {}
    for event in events:
        by_name[event.name] = by_name.get(event.name, 0.0) + event.duration_ns
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:3]
    return dict(
        device_us=sum(e.duration_ns for e in events) / calls / 1e3,
        kernels_per_call=len(events) / calls,
        top_kernels={kernel_gaps.short_name(n)[:60]: ns / calls / 1e3 for n, ns in top},
    )


def same_bits(got, want) -> bool:
    """Every int32 array of two results (tuples or `RoutingMetadata`) equal, shapes included."""
    return all(
        np.asarray(g).dtype == np.int32
        and np.asarray(g).shape == np.asarray(w).shape
        and np.array_equal(np.asarray(g), np.asarray(w))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )


def bench_shape(shape: Shape, args) -> tuple[list[dict], bool]:
    """JSON rows of one shape, and whether every check passed."""
    timed, awkward = (jnp.asarray(a) for a in routings(shape, args.seed))
    if args.metadata:
        fns = {
            name: jax.jit(fn)
            for name, fn in metadata_candidates(shape, jax.default_backend() != "gpu").items()
        }
        return time_candidates(shape, fns, timed, awkward, {}, args)
    fns = {
        name: jax.jit(
            functools.partial(
                layouts.contiguous_destinations,
                method=ranker,
                num_experts=shape.num_experts,
                alignment=ALIGNMENT,
            )
        )
        for name, ranker in candidates(shape).items()
    }
    oracle_ok = {}
    for label, ids in (("timed", timed), ("awkward", awkward)):
        want = fns[next(iter(fns))](ids)  # "current" comes first
        oracle = numpy_destinations(np.asarray(ids), shape.num_experts, ALIGNMENT)
        oracle_ok[label] = all(
            np.array_equal(np.asarray(g), w) for g, w in zip(want, oracle, strict=True)
        )
        if not oracle_ok[label]:
            print(f"MISMATCH: {shape.name} current vs NumPy on the {label} ids", file=sys.stderr)
    return time_candidates(shape, fns, timed, awkward, oracle_ok, args)


def time_candidates(shape, fns, timed, awkward, oracle_ok, args) -> tuple[list[dict], bool]:
    """Checks every candidate against the first, bit for bit, on both routings, then times it."""
    ok = all(oracle_ok.values())
    expected = {
        label: fns[next(iter(fns))](ids) for label, ids in (("timed", timed), ("awkward", awkward))
    }
    on_gpu = jax.default_backend() == "gpu" and not args.no_profile
    rows = []
    for name, fn in fns.items():
        checks = [
            same_bits(fn(ids), expected[label])
            for label, ids in (("timed", timed), ("awkward", awkward))
        ]
        exact = all(checks)
        ok &= exact
        measured = timing.time_calls(
            lambda fn=fn: fn(timed),
            wait=jax.block_until_ready,
            samples=args.samples,
            burst=args.burst,
        )
        row = dict(
            shape=shape.name,
            T=shape.num_tokens,
            k=shape.topk,
            E=shape.num_experts,
            P=shape.num_pairs,
            method=name,
            host_us=measured.streamed_ms * 1e3,
            check="exact" if exact else "MISMATCH",
        )
        if on_gpu:
            row |= device_time(fn, timed, args.trace_samples, args.burst)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows, ok


def format_table(rows: list[dict]) -> str:
    """Host and device us per call, and the ratio to "current" of the same shape."""
    current = {}
    for r in rows:  # the first candidate of each shape ("current", or "xla" with --metadata)
        current.setdefault(r["shape"], r)
    lines = [
        f"{'shape':<12} {'P':>6} {'E':>4} {'method':<32} {'host us':>8} {'x cur':>6} "
        f"{'dev us':>7} {'x cur':>6} {'kern':>5}  check"
    ]
    for r in rows:
        base = current[r["shape"]]
        dev = r.get("device_us")
        dev_base = base.get("device_us")
        lines.append(
            f"{r['shape']:<12} {r['P']:>6} {r['E']:>4} {r['method']:<32} {r['host_us']:>8.1f} "
            f"{r['host_us'] / base['host_us']:>6.2f} "
            + (
                f"{dev:>7.1f} {dev / dev_base:>6.2f} "
                if dev and dev_base
                else f"{'-':>7} {'-':>6} "
            )
            + (f"{r['kernels_per_call']:>5.1f}" if "kernels_per_call" in r else f"{'-':>5}")
            + f"  {r['check']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--samples", type=int, default=15, help="host-timed samples (median)")
    parser.add_argument("--burst", type=int, default=50, help="back-to-back calls per sample")
    parser.add_argument("--trace-samples", type=int, default=3, help="bursts traced on a GPU")
    parser.add_argument("--no-profile", action="store_true", help="host timing only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--metadata", action="store_true", help="time the whole routing metadata, XLA vs Pallas"
    )
    parser.add_argument("--json", help="also write the rows to this JSON-lines file")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print(
            f"backend {jax.default_backend()!r}: host timing only (a CPU says nothing of the GPU)",
            file=sys.stderr,
        )
    rows, ok = [], True
    for name in args.shapes:
        shape_rows, shape_ok = bench_shape(SHAPES[name], args)
        rows += shape_rows
        ok &= shape_ok
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    if not ok:
        print("MISMATCH: see the rows marked above", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
