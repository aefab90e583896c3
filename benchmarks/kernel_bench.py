"""Benchmark of the Pallas data-movement kernels against XLA and device copy bandwidth.

    python -m benchmarks.kernel_bench              # on a GPU: shapes A and B
    python -m benchmarks.kernel_bench --sweep      # also time a few block configs, keep the best
    python -m benchmarks.kernel_bench --tiny --interpret   # CPU smoke run of this script
    python -m benchmarks.kernel_bench --kernels metadata --sweep   # one kernel family

Kernels: permute (bf16 and FP8 rows with scales), the contiguous layout's routing metadata
(inverse, counts, segment ends, each row's token and expert), unpermute (weighted gather-sum),
group_quant (FP8 quantization of the tokens) and act_and_quant (silu(gate) * up + FP8
quantization). Each runs through its public front op (`moe_jax.permute.permute(impl=...)`,
`moe_jax.act_quant.group_quant(impl=...)`, ...) with `impl="pallas"` (or "pallas_interpret"),
against `impl="xla"`; `--sweep` also calls the kernel wrappers of `moe_jax.kernels` with other
configs. Times come from `moe_jax.cli.timing.time_calls` (streamed: medians over samples of
back-to-back calls, after warm-up).

Bytes moved count each input byte read once and each output byte written once: permute reads x
(+ scales, ids) and writes all M rows of the layout (padding included: it is output) plus the
metadata; unpermute reads the T*k gathered rows, inverse and weights, and writes [T, H]. The
copy ceiling is a jitted elementwise pass over a ~2 GB array (bytes read + written). Routing:
uniform random experts per slot (duplicates allowed), as in an untrained router.
"metadata" times `moe_jax.permute.routing_metadata` (the one Pallas kernel of
`moe_jax.kernels.routing_metadata` against the XLA reference, bit for bit, alignment 128): the
part of the permute that is not the row copy. A kernel that fails to compile or run prints its
error and a FAILED row; the other kernels still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kernel_report
from moe_jax import act_quant, layouts
from moe_jax import permute as permute_op
from moe_jax.cli.timing import time_calls
from moe_jax.kernels import act_quant as act_quant_kernels
from moe_jax.kernels import permute as permute_kernel
from moe_jax.kernels import routing_metadata as metadata_kernel
from moe_jax.kernels import unpermute as unpermute_kernel
from moe_jax.kernels.act_quant import heuristic_config as act_quant_heuristic
from moe_jax.kernels.permute import heuristic_config as permute_heuristic
from moe_jax.kernels.routing_metadata import heuristic_config as metadata_heuristic
from moe_jax.kernels.unpermute import heuristic_config as unpermute_heuristic


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    num_tokens: int
    topk: int
    hidden: int
    num_experts: int
    intermediate: int


SHAPES = {
    "A": Shape("A", 4096, 8, 7168, 32, 2048),
    "B": Shape("B", 8192, 8, 2048, 128, 768),
    "tiny": Shape("tiny", 64, 4, 256, 8, 128),
    # Decode-size layers of `bench --decode` (DeepSeek-V3 experts): GEMM1's output has about
    # T*k*16 rows there (16-row segments); these give act_and_quant 128 and 2944 rows.
    "decode_1": Shape("decode_1", 16, 8, 7168, 256, 2048),
    "decode_32": Shape("decode_32", 368, 8, 7168, 256, 2048),
}
# Overrides of the heuristic config timed by --sweep; "2h" doubles block_h, "h/2" halves it.
PERMUTE_SWEEP = [
    dict(has_eviction_hints=False),
    dict(block_m=8),
    dict(block_m=32, num_warps=8),
    dict(num_warps=8),
]
METADATA_SWEEP = [
    dict(block_c="c/2"),
    dict(block_c="2c"),
    dict(block_p=32),
    dict(block_p=128),
    dict(num_warps=8),
]
QUANT_SWEEP = [  # overrides of the heuristic (16 rows x 2 groups, 4 warps, group-major)
    dict(block_m=8),
    dict(block_m=32),
    dict(block_m=32, groups_per_program=1),  # the heuristic before 2026-12-02, evening
    dict(groups_per_program=1),
    dict(block_m=8, num_warps=2, groups_per_program=1),
    dict(block_m=64, num_warps=8),
    dict(block_m=128, num_warps=8),
    dict(groups_per_program=4, num_warps=8),
    dict(is_group_major=False),
]
KERNEL_FAMILIES = ("permute", "metadata", "unpermute", "quant")
UNPERMUTE_SWEEP = [
    dict(has_eviction_hints=False),
    dict(block_t=2),
    dict(num_warps=8),
    dict(block_t=2, block_h="h/2"),
    dict(block_t=4, block_h="h/2", num_warps=8),
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timer:
    """Streamed timing in microseconds: `samples` medians of `burst` back-to-back calls."""

    samples: int
    burst: int

    def us(self, fn: Callable, *args) -> float:
        timing = time_calls(
            lambda: fn(*args), wait=jax.block_until_ready, samples=self.samples, burst=self.burst
        )
        return timing.streamed_ms * 1e3


def _override(base, change):
    sizes = {}
    if hasattr(base, "block_h"):
        sizes.update({"2h": 2 * base.block_h, "h/2": max(1, base.block_h // 2)})
    if hasattr(base, "block_c"):
        sizes.update({"2c": 2 * base.block_c, "c/2": max(base.block_p, base.block_c // 2)})
    return dataclasses.replace(base, **{k: sizes.get(v, v) for k, v in change.items()})


def copy_bandwidth(num_bytes: int, timer: Timer) -> float:
    """Device-to-device GB/s of an elementwise pass (read + write) over num_bytes."""
    a = jax.random.bits(jax.random.key(0), (num_bytes // 4,), jnp.uint32)
    flip = jax.jit(lambda v: v ^ jnp.uint32(1))
    return 2 * a.nbytes / timer.us(flip, a) / 1e3


def fill_bandwidth(num_bytes: int, timer: Timer) -> float:
    """GB/s of writing num_bytes (no reads): the ceiling of a write-dominated op like permute."""
    fill = jax.jit(functools.partial(jnp.full, (num_bytes // 4,), dtype=jnp.uint32))
    return num_bytes // 4 * 4 / timer.us(fill, jnp.uint32(7)) / 1e3


def _nbytes(*arrays) -> int:
    return sum(a.size * a.dtype.itemsize for a in arrays if a is not None)


def _is_bit_equal(got, want) -> bool:
    return all(
        np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )


def _fastest(timer: Timer, candidates: list[tuple[str, Callable]], *args):
    """(us, name, fn) of the fastest candidate, after printing each one's time with --sweep."""
    results = [(timer.us(fn, *args), name, fn) for name, fn in candidates]
    if len(results) > 1:
        for us, name, _ in results:
            print(f"  sweep {us:9.1f} us  {name}")
    return min(results, key=lambda r: r[0])


def _bench_permute(shape, x, q, scales, ids, *, impl, sweep, timer, copy_gbs):
    rows = []
    E = shape.num_experts
    num_rows = layouts.contiguous_num_rows(
        shape.num_tokens, shape.topk, E, layouts.DEFAULT_ALIGNMENT
    )
    for dtype_name, xs, xscales in [("bf16", x, None), ("fp8+scales", q, scales)]:
        front = functools.partial(permute_op.permute, num_experts=E, x_scales=xscales)
        candidates = [
            (f"impl={impl!r} (heuristic config)", jax.jit(functools.partial(front, impl=impl)))
        ]
        if sweep:
            base = permute_heuristic(num_rows, shape.hidden, xs.dtype.itemsize)
            for change in PERMUTE_SWEEP:
                config = _override(base, change)
                candidates.append(
                    (
                        str(config),
                        functools.partial(
                            _permute_with,
                            num_experts=E,
                            x_scales=xscales,
                            config=config,
                            interpret=impl == "pallas_interpret",
                        ),
                    )
                )
        us, name, fn = _fastest(timer, candidates, xs, ids)
        xla = jax.jit(functools.partial(front, impl="xla"))
        got = fn(xs, ids)
        moved = _nbytes(xs, xscales, ids) + _nbytes(*jax.tree.leaves(got))
        rows.append(
            kernel_report.row(
                "permute",
                shape.name,
                dtype_name,
                us=us,
                xla_us=timer.us(xla, xs, ids),
                moved=moved,
                copy_gbs=copy_gbs,
                check="exact" if _is_bit_equal(got, xla(xs, ids)) else "MISMATCH",
                config=name,
            )
        )
    return rows


def _permute_with(x, ids, *, num_experts, x_scales, config, interpret):
    """The permute with the copy kernel at `config`: route (XLA), then `gather_rows`."""
    lay = permute_op.route(ids, num_experts=num_experts)
    rows, row_scales = permute_kernel.gather_rows(
        x, x_scales, lay.sources, config=config, interpret=interpret
    )
    return dataclasses.replace(lay, rows=rows, row_scales=row_scales, sources=None)


def _failed_row(kernel: str, shape, error: Exception, copy_gbs: float) -> dict:
    message = f"{type(error).__name__}: {error}".splitlines()[0][:200]
    print(f"[{shape.name}] {kernel} FAILED: {message}", flush=True)
    return kernel_report.row(
        kernel, shape.name, "int32", us=float("nan"), copy_gbs=copy_gbs, check=f"FAILED {message}"
    )


def _bench_metadata(shape, ids, *, impl, sweep, timer, copy_gbs):
    """The Pallas routing metadata against XLA's, on the local ids of the routing (alignment
    128)."""
    E, alignment = shape.num_experts, layouts.DEFAULT_ALIGNMENT
    local = layouts.map_expert_ids(ids, num_experts=E)
    num_rows = layouts.contiguous_num_rows(shape.num_tokens, shape.topk, E, alignment)
    shared = dict(num_experts=E, alignment=alignment, num_rows=num_rows)
    front = functools.partial(permute_op.routing_metadata, **shared)
    xla = jax.jit(functools.partial(front, impl="xla"))
    try:
        candidates = [
            (f"impl={impl!r} (heuristic config)", jax.jit(functools.partial(front, impl=impl)))
        ]
        if sweep:
            base = metadata_heuristic(local.size, E)
            for change in METADATA_SWEEP:
                try:
                    config = _override(base, change)
                except ValueError:  # e.g. block_p past a small shape's chunk
                    continue
                candidates.append(
                    (
                        str(config),
                        functools.partial(
                            metadata_kernel.routing_metadata,
                            **shared,
                            config=config,
                            interpret=impl == "pallas_interpret",
                        ),
                    )
                )
        us, name, fn = _fastest(timer, candidates, local)
        check = "exact" if _is_bit_equal(fn(local), xla(local)) else "MISMATCH"
    except Exception as error:  # report a lowering failure and go on with the other kernels
        return [_failed_row("metadata", shape, error, copy_gbs)]
    return [
        kernel_report.row(
            "metadata",
            shape.name,
            "int32",
            us=us,
            xla_us=timer.us(xla, local),
            moved=_nbytes(local, *jax.tree.leaves(fn(local))),
            copy_gbs=copy_gbs,
            check=check,
            config=name,
        )
    ]


def _bench_unpermute(shape, x, ids, weights, rng, *, impl, sweep, timer, copy_gbs):
    T, k, H, E = shape.num_tokens, shape.topk, shape.hidden, shape.num_experts
    lay = permute_op.permute(x, ids, num_experts=E, impl="xla")
    # Expert outputs are bf16 (GEMM2's output) in both the bf16 and FP8 pipelines.
    y = jnp.asarray(rng.standard_normal(lay.rows.shape), jnp.bfloat16)
    candidates = [
        (
            f"impl={impl!r} (heuristic config)",
            jax.jit(functools.partial(permute_op.unpermute, impl=impl)),
        )
    ]
    if sweep:
        base = unpermute_heuristic(T, H)
        for change in UNPERMUTE_SWEEP:
            config = _override(base, change)
            candidates.append(
                (
                    str(config),
                    functools.partial(
                        unpermute_kernel.unpermute,
                        config=config,
                        interpret=impl == "pallas_interpret",
                    ),
                )
            )
    us, name, fn = _fastest(timer, candidates, y, lay.inverse, weights)
    xla = jax.jit(functools.partial(permute_op.unpermute, impl="xla"))
    got = np.asarray(fn(y, lay.inverse, weights), np.float32)
    want = np.asarray(xla(y, lay.inverse, weights), np.float32)
    err = float(np.max(np.abs(got - want)))
    is_close = bool(np.allclose(got, want, rtol=1e-2, atol=1e-2))  # one bf16 rounding
    moved = _nbytes(lay.inverse, weights) + T * k * H * 2 + T * H * 2
    return [
        kernel_report.row(
            "unpermute",
            shape.name,
            "bf16",
            us=us,
            xla_us=timer.us(xla, y, lay.inverse, weights),
            moved=moved,
            copy_gbs=copy_gbs,
            check=f"{'ok' if is_close else 'MISMATCH'} max abs err {err:.1e}",
            config=name,
        )
    ]


def _bench_quant(shape, x, rng, *, impl, sweep, timer, copy_gbs):
    """group_quant of the tokens [T, H], act_and_quant of GEMM1's output [T*k, 2I], and
    act_and_quant as the FP8 layer calls it ("act_and_quant ids": the same rows followed by the
    contiguous layout's E * (alignment - 1) padding rows, with the layout's expert ids, so
    all-padding blocks are skipped); with `sweep`, the kernels with `QUANT_SWEEP`'s configs too,
    each checked bit for bit against the heuristic config's output first (the tiling moves no
    arithmetic). Padding rows are unspecified, so checks compare the used rows only."""
    used = shape.num_tokens * shape.topk
    h = jnp.asarray(rng.standard_normal((used, 2 * shape.intermediate)), jnp.bfloat16)
    padding = shape.num_experts * (layouts.DEFAULT_ALIGNMENT - 1)
    h_padded = jnp.pad(h, ((0, padding), (0, 0)))
    ids = jnp.concatenate([jnp.zeros(used, jnp.int32), jnp.full(padding, -1, jnp.int32)])
    rows = []
    cases = [
        ("group_quant", act_quant.group_quant, act_quant_kernels.group_quant, x, {}),
        ("act_and_quant", act_quant.act_and_quant, act_quant_kernels.act_and_quant, h, {}),
        (
            "act_and_quant ids",
            act_quant.act_and_quant,
            act_quant_kernels.act_and_quant,
            h_padded,
            {"expert_ids": ids},
        ),
    ]
    for name, op, kernel, operand, extra in cases:
        num_used = operand.shape[0] if not extra else used

        def used_rows(out, num_used=num_used):
            return tuple(a[:num_used] for a in out)

        front = jax.jit(functools.partial(op, impl=impl, **extra))
        xla = jax.jit(functools.partial(op, impl="xla", **extra))
        heuristic = used_rows(front(operand))
        candidates = [(f"impl={impl!r} (heuristic config)", front)]
        if sweep:
            columns = operand.shape[1] // (2 if op is act_quant.act_and_quant else 1)
            base = act_quant_heuristic(operand.shape[0], columns // 128)
            for change in QUANT_SWEEP:
                config = _override(base, change)
                fn = jax.jit(
                    functools.partial(
                        kernel, config=config, interpret=impl == "pallas_interpret", **extra
                    )
                )
                if _is_bit_equal(used_rows(fn(operand)), heuristic):
                    candidates.append((str(config), fn))
                else:
                    print(f"  sweep {config}: output differs from the heuristic's, not timed")
        us, config_name, fn = _fastest(timer, candidates, operand)
        got, want = used_rows(fn(operand)), used_rows(xla(operand))
        rows.append(
            kernel_report.row(
                name,
                shape.name,
                "bf16->fp8",
                us=us,
                xla_us=timer.us(xla, operand),
                moved=_nbytes(operand[:num_used], *got),
                copy_gbs=copy_gbs,
                check="exact" if _is_bit_equal(got, want) else "differs from xla",
                config=config_name,
            )
        )
    return rows


def run(args: argparse.Namespace) -> tuple[list[dict], float, float]:
    """(table rows, copy GB/s, fill GB/s)."""
    timer = Timer(samples=args.batches, burst=args.per_batch)
    impl = "pallas_interpret" if args.interpret else "pallas"
    copy_gbs = copy_bandwidth(args.copy_bytes, timer)
    fill_gbs = fill_bandwidth(args.copy_bytes, timer)
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}", flush=True)
    rows = []
    rng = np.random.default_rng(0)
    for shape in [SHAPES[s] for s in args.shapes]:
        print(f"[{shape.name}] {', '.join(args.kernels)}", flush=True)
        T, k, H, E = shape.num_tokens, shape.topk, shape.hidden, shape.num_experts
        ids = jnp.asarray(rng.integers(0, E, (T, k)), jnp.int32)
        weights = jnp.asarray(rng.random((T, k)), jnp.float32)
        x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
        q, scales = act_quant.group_quant(x, impl="xla")
        common = dict(impl=impl, timer=timer, copy_gbs=copy_gbs)
        if "permute" in args.kernels:
            rows += _bench_permute(shape, x, q, scales, ids, sweep=args.sweep, **common)
        if "metadata" in args.kernels:
            rows += _bench_metadata(shape, ids, sweep=args.sweep, **common)
        if "unpermute" in args.kernels:
            rows += _bench_unpermute(shape, x, ids, weights, rng, sweep=args.sweep, **common)
        if "quant" in args.kernels:
            rows += _bench_quant(shape, x, rng, sweep=args.sweep, **common)
    return rows, copy_gbs, fill_gbs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["A", "B"], choices=sorted(SHAPES))
    parser.add_argument("--tiny", action="store_true", help="only the tiny shape (smoke run)")
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    parser.add_argument("--sweep", action="store_true", help="time a few configs, keep the best")
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=list(KERNEL_FAMILIES),
        choices=KERNEL_FAMILIES,
        help="kernel families to time (default: all)",
    )
    parser.add_argument("--batches", type=int, default=15, help="timed samples (median)")
    parser.add_argument("--per-batch", type=int, default=20, help="back-to-back calls per sample")
    parser.add_argument("--copy-bytes", type=int, default=2 << 30)
    args = parser.parse_args(argv)
    if args.tiny:
        args.shapes, args.batches, args.per_batch, args.copy_bytes = ["tiny"], 2, 2, 1 << 20
    rows, copy_gbs, fill_gbs = run(args)
    print(kernel_report.format_table(rows, copy_gbs=copy_gbs, fill_gbs=fill_gbs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
