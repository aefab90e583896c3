"""Benchmark of the Pallas permute / unpermute kernels against XLA and device copy bandwidth.

    python -m moe_jax.kernels.bench              # on a GPU: shapes A and B, bf16 and FP8+scales
    python -m moe_jax.kernels.bench --sweep      # also time a few block configs, report the best
    python -m moe_jax.kernels.bench --tiny --interpret   # CPU smoke run of this script

Bytes moved count each input byte read once and each output byte written once: permute reads x
(+ scales, ids) and writes all M rows of the layout (padding included: it is output) plus the
metadata; unpermute reads the T*k gathered rows, inverse and weights, and writes [T, H]. The
copy ceiling is a jitted elementwise pass over a ~2 GB array (bytes read + written). Times are
medians over batches of back-to-back calls (async dispatch hides launch gaps), after a warm-up.
Routing: uniform random experts per slot (duplicates allowed), as in an untrained router.
"metadata alone" times the jnp routing metadata by itself, which is bound by host dispatch of its
small XLA kernels; inside permute that is hidden, and "permute - row copy" is its device cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import layouts
from moe_jax.kernels.permute import _gather_rows, permute, routing_metadata
from moe_jax.kernels.permute import heuristic_config as permute_heuristic
from moe_jax.kernels.unpermute import heuristic_config as unpermute_heuristic
from moe_jax.kernels.unpermute import unpermute
from moe_jax.quant import per_token_group_quant_fp8


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    num_tokens: int
    topk: int
    hidden: int
    num_experts: int


SHAPES = {
    "A": Shape("A", 4096, 8, 7168, 32),
    "B": Shape("B", 8192, 8, 2048, 128),
    "tiny": Shape("tiny", 64, 4, 256, 8),
}
# Overrides of the heuristic config timed by --sweep; "2h" doubles block_h, "h/2" halves it.
PERMUTE_SWEEP = [
    dict(has_eviction_hints=False),
    dict(block_m=8),
    dict(block_m=32, num_warps=8),
    dict(num_warps=8),
    dict(block_rank=32),
    dict(block_rank=128),
]
UNPERMUTE_SWEEP = [
    dict(has_eviction_hints=False),
    dict(block_t=2),
    dict(num_warps=8),
    dict(block_t=2, block_h="h/2"),
    dict(block_t=4, block_h="h/2", num_warps=8),
]


def _override(base, change):
    sizes = {"2h": 2 * base.block_h, "h/2": max(1, base.block_h // 2)}
    return dataclasses.replace(base, **{k: sizes.get(v, v) for k, v in change.items()})


def time_us(fn, *args, batches: int, per_batch: int) -> float:
    """Median over `batches` of the mean time of `per_batch` back-to-back calls, in us."""
    jax.block_until_ready(fn(*args))  # compile + warm-up
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(per_batch):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / per_batch * 1e6)
    return statistics.median(samples)


def copy_bandwidth(num_bytes: int, timing) -> float:
    """Device-to-device GB/s of an elementwise pass (read + write) over num_bytes."""
    a = jax.random.bits(jax.random.key(0), (num_bytes // 4,), jnp.uint32)
    flip = jax.jit(lambda v: v ^ jnp.uint32(1))
    us = time_us(flip, a, **timing)
    return 2 * a.nbytes / us / 1e3


def fill_bandwidth(num_bytes: int, timing) -> float:
    """GB/s of writing num_bytes (no reads): the ceiling of a write-dominated op like permute."""
    fill = jax.jit(functools.partial(jnp.full, (num_bytes // 4,), dtype=jnp.uint32))
    us = time_us(fill, jnp.uint32(7), **timing)
    return num_bytes // 4 * 4 / us / 1e3


def _metadata(ids, *, num_experts, num_rows):
    local = layouts.map_expert_ids(ids, num_experts=num_experts)
    return routing_metadata(
        local, num_experts=num_experts, alignment=layouts.DEFAULT_ALIGNMENT, num_rows=num_rows
    )


_jitted_gather_rows = jax.jit(_gather_rows, static_argnames=("config", "interpret"))


def pl_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _nbytes(*arrays) -> int:
    return sum(a.size * a.dtype.itemsize for a in arrays if a is not None)


def _best(results):
    return min(results, key=lambda r: r[0])


def run(args) -> list[dict]:
    timing = dict(batches=args.batches, per_batch=args.per_batch)
    interpret = args.interpret
    copy_gbs = copy_bandwidth(args.copy_bytes, timing)
    fill_gbs = fill_bandwidth(args.copy_bytes, timing)
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}")
    rows = []
    rng = np.random.default_rng(0)
    for shape in [SHAPES[s] for s in args.shapes]:
        T, k, H, E = shape.num_tokens, shape.topk, shape.hidden, shape.num_experts
        ids = jnp.asarray(rng.integers(0, E, (T, k)), jnp.int32)
        weights = jnp.asarray(rng.random((T, k)), jnp.float32)
        x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
        q, scales = per_token_group_quant_fp8(x)
        num_rows = layouts.contiguous_num_rows(T, k, E, layouts.DEFAULT_ALIGNMENT)
        for dtype_name, xs, xscales in [("bf16", x, None), ("fp8+scales", q, scales)]:
            reference = jax.jit(functools.partial(layouts.permute_reference, num_experts=E))
            configs = [None]
            if args.sweep:
                base = permute_heuristic(num_rows, H, xs.dtype.itemsize)
                configs += [_override(base, change) for change in PERMUTE_SWEEP]
            results = []
            for config in configs:
                fn = functools.partial(
                    permute, x_scales=xscales, num_experts=E, config=config, interpret=interpret
                )
                results.append((time_us(fn, xs, ids, **timing), str(config), fn))
            us, config_name, fn = _best(results)
            got, want = fn(xs, ids), reference(xs, ids, x_scales=xscales)
            exact = all(
                np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
            )
            xla_us = time_us(functools.partial(reference, x_scales=xscales), xs, ids, **timing)
            moved = _nbytes(xs, xscales, ids) + _nbytes(*jax.tree.leaves(got))
            rows.append(_row("permute", shape, dtype_name, us, xla_us, moved, copy_gbs, exact))
            rows[-1]["config"] = config_name
            if args.sweep:
                for r_us, r_name, _ in results:
                    print(f"  sweep permute {shape.name} {dtype_name} {r_us:9.1f} us  {r_name}")
            if dtype_name == "bf16":  # where the permute time goes
                meta = jax.jit(functools.partial(_metadata, num_experts=E, num_rows=num_rows))
                meta_us = time_us(meta, ids, **timing)
                source = meta(ids)[3]
                copy_only = functools.partial(
                    _jitted_gather_rows,
                    config=permute_heuristic(num_rows, H, 2),
                    interpret=interpret,
                )
                copy_us = time_us(copy_only, xs, None, source, **timing)
                moved_copy = _nbytes(xs, source) + num_rows * H * 2
                rows.append(
                    _row("  metadata alone", shape, "int32", meta_us, None, 0, copy_gbs, None)
                )
                rows.append(
                    _row(
                        "  permute - row copy",
                        shape,
                        "int32",
                        us - copy_us,
                        None,
                        0,
                        copy_gbs,
                        None,
                    )
                )
                rows.append(
                    _row("  row copy", shape, dtype_name, copy_us, None, moved_copy, copy_gbs, None)
                )
                # Same kernel, source = identity over a T-row x tiled to M rows: no gather.
                tiled = jnp.tile(xs, (pl_cdiv(num_rows, T), 1))[:num_rows]
                identity = jnp.arange(num_rows, dtype=jnp.int32)
                ident_us = time_us(copy_only, tiled, None, identity, **timing)
                moved_ident = 2 * num_rows * H * 2 + num_rows * 4
                rows.append(
                    _row(
                        "  plain copy",
                        shape,
                        dtype_name,
                        ident_us,
                        None,
                        moved_ident,
                        copy_gbs,
                        None,
                    )
                )

        # Unpermute: expert outputs are bf16 (GEMM2 output) in both the bf16 and FP8 pipelines.
        lay = layouts.permute_reference(x, ids, num_experts=E)
        y = jnp.asarray(rng.standard_normal((num_rows, H)), jnp.bfloat16)
        reference = jax.jit(layouts.unpermute_reference)
        configs = [None]
        if args.sweep:
            base = unpermute_heuristic(T, H)
            configs += [_override(base, change) for change in UNPERMUTE_SWEEP]
        results = []
        for config in configs:
            fn = functools.partial(unpermute, config=config, interpret=interpret)
            results.append((time_us(fn, y, lay.inverse, weights, **timing), str(config), fn))
        us, config_name, fn = _best(results)
        got = np.asarray(fn(y, lay.inverse, weights), np.float32)
        want = np.asarray(reference(y, lay.inverse, weights), np.float32)
        err = float(np.max(np.abs(got - want)))
        is_close = bool(np.allclose(got, want, rtol=1e-2, atol=1e-2))  # one bf16 rounding
        xla_us = time_us(reference, y, lay.inverse, weights, **timing)
        moved = _nbytes(lay.inverse, weights) + T * k * H * 2 + T * H * 2
        rows.append(_row("unpermute", shape, "bf16", us, xla_us, moved, copy_gbs, is_close))
        rows[-1]["config"] = f"{config_name} max|err|={err:.1e}"
        if args.sweep:
            for r_us, r_name, _ in results:
                print(f"  sweep unpermute {shape.name} {r_us:9.1f} us  {r_name}")
    return rows, copy_gbs, fill_gbs


def _row(kernel, shape, dtype, us, xla_us, moved, copy_gbs, ok):
    gbs = moved / us / 1e3 if moved else float("nan")
    return dict(
        kernel=kernel,
        shape=shape.name,
        dtype=dtype,
        us=us,
        gbs=gbs,
        pct=100 * gbs / copy_gbs,
        xla_us=xla_us,
        speedup=None if xla_us is None else xla_us / us,
        ok=ok,
    )


def print_table(rows, copy_gbs, fill_gbs):
    print(f"\ncopy bandwidth (read+write): {copy_gbs:.0f} GB/s")
    print(f"fill bandwidth (write only): {fill_gbs:.0f} GB/s")
    print(
        "| kernel | shape | dtype | time us | GB/s | % copy BW | % fill BW | XLA us | speedup "
        "| correct |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        xla = "" if r["xla_us"] is None else f"{r['xla_us']:.1f}"
        speed = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        gbs = "" if np.isnan(r["gbs"]) else f"{r['gbs']:.0f}"
        pct = "" if np.isnan(r["pct"]) else f"{r['pct']:.0f}%"
        pct_fill = "" if np.isnan(r["gbs"]) else f"{100 * r['gbs'] / fill_gbs:.0f}%"
        ok = "" if r["ok"] is None else ("exact" if r["ok"] is True else str(r["ok"]))
        if r["kernel"] == "unpermute" and r["ok"] is not None:
            ok = "ok" if r["ok"] else "MISMATCH"
        print(
            f"| {r['kernel']} | {r['shape']} | {r['dtype']} | {r['us']:.1f} | {gbs} | {pct} "
            f"| {pct_fill} | {xla} | {speed} | {ok} |"
        )
    for r in rows:
        if "config" in r:
            print(f"  {r['kernel']} {r['shape']} {r['dtype']}: {r['config']}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["A", "B"], choices=sorted(SHAPES))
    parser.add_argument("--tiny", action="store_true", help="only the tiny shape (smoke run)")
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    parser.add_argument("--sweep", action="store_true", help="time a few configs, keep the best")
    parser.add_argument("--batches", type=int, default=15)
    parser.add_argument("--per-batch", type=int, default=20)
    parser.add_argument("--copy-bytes", type=int, default=2 << 30)
    args = parser.parse_args(argv)
    if args.tiny:
        args.shapes, args.batches, args.per_batch, args.copy_bytes = ["tiny"], 2, 2, 1 << 20
    # The Triton backend is deprecated in jax >= 0.11 but is the one that gathers rows on Hopper.
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    rows, copy_gbs, fill_gbs = run(args)
    print_table(rows, copy_gbs, fill_gbs)


if __name__ == "__main__":
    main()
