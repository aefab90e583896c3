"""`python -m benchmarks.gemm_sweep`: tile sweep of the decode grouped GEMMs (Pallas, Mosaic).

For each token count T it builds the contiguous layout of a decode batch routed like `bench
--decode`, with the segment multiple the layer itself would use for that T
(`moe_jax.plan.segment_alignment`: 16, 32 or 64 rows by pairs per expert) unless `--alignment` fixes
it (DeepSeek-V3 on one GPU by default), then times
`moe_jax.kernels.grouped_gemm_contiguous` for GEMM1 ([M, H] x [E, 2I, H]) and GEMM2
([M, I] x [E, H, I]) with the heuristic's tiles and each candidate of `CANDIDATES`, and on
layouts of 64-row segments the Mosaic GPU FP8 kernel (`moe_jax.kernels.mosaic_fp8_gemm`) with
each of `MOSAIC_CANDIDATES` and its own heuristic's config (labelled "[mosaic heuristic]";
`--candidates` picks either set). "heuristic" alone is the Pallas kernel's. Every candidate
is checked first against the heuristic's output, and the heuristic's output against the
float32 reference on 16 rows spread over the layout (both within `TOLERANCE`; a config that
is not is reported, not timed, and a wrong heuristic makes the command exit with status 1). It
prints, per T and GEMM, each config's streamed microseconds and its weight-read bandwidth (the
active experts' FP8 weights and scales over the time), best first:

    python -m benchmarks.gemm_sweep --tokens 1 32 128 --json sweep.json

This is the evidence behind `moe_jax.kernels.grouped_gemm.heuristic_config` and
`moe_jax.kernels.mosaic_fp8_config.heuristic_config`. Without a GPU it
runs the tiny shape in interpret mode (slow, but the command can be tested anywhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import grouped_gemm, layouts, quant
from moe_jax.cli import decode_bench
from moe_jax.cli.timing import BURST, rel_error, time_calls
from moe_jax.kernels import grouped_gemm as gemm_kernels
from moe_jax.kernels import mosaic_fp8_gemm
from moe_jax.plan import segment_alignment

ALIGNMENT = 16  # sweep_one's default segment multiple (the layer's for <= 16 pairs per expert)
CHECK_ROWS = 16
# Relative error allowed against float32 (heuristic) and against the heuristic (candidates):
# bf16 output rounding plus Hopper's FP8 MMA, whose 128-wide block sums depend on the tiling.
TOLERANCE = 1e-2
# Changes to the heuristic's config around its choices (`GroupedGemmConfig`): tiles, warps,
# stages and the transposed dot, each with the grid launched row blocks first and column tiles
# first.
CANDIDATES = tuple(
    dict(
        block_n=bn,
        block_k=bk,
        num_warps=warps,
        num_stages=stages,
        is_transposed=t,
        is_column_major=columns_first,
    )
    for columns_first in (False, True)
    for bn, bk, warps, stages, t in (
        (64, 128, 4, 4, False),
        (64, 128, 4, 6, False),
        (128, 128, 4, 4, False),
        (128, 128, 8, 4, False),
        (32, 128, 4, 4, False),
        (64, 64, 4, 6, False),
        (64, 128, 4, 4, True),
        (128, 128, 4, 3, True),
        (128, 128, 4, 5, True),
        (128, 128, 8, 4, True),
        (128, 64, 4, 6, True),
    )
) + tuple(
    # 128-row blocks (two warpgroups' wgmma rows), for layouts of 128-row segments (--alignment).
    dict(
        block_m=128,
        block_n=128,
        block_k=128,
        num_warps=warps,
        num_stages=stages,
        is_transposed=False,
        is_column_major=True,
    )
    for warps, stages in ((8, 3), (8, 4), (4, 3))
)


# The Mosaic GPU FP8 kernel's configs (`moe_jax.kernels.mosaic_fp8_gemm`), timed on layouts of
# 64-row segments beside the Pallas kernel's: two compute warpgroups of 128 columns, an expert's
# row blocks in groups of 1-16 taking each column tile in turn, 3-4 pipeline slots, one pipeline
# per tile or chained across tiles; then two K blocks per step with both wgmmas in flight (2
# slots of those hold as many blocks as 4 of the others), one by one or in groups of 2 or 4.
MOSAIC_CANDIDATES = tuple(
    mosaic_fp8_gemm.MosaicFp8GemmConfig(
        block_n=128,
        group_blocks=group,
        max_concurrent_steps=steps,
        is_chained=chained,
        is_overlapped=overlapped,
    )
    for group, steps, chained, overlapped in (
        (1, 3, False, False),
        (1, 4, False, False),
        (1, 4, True, False),
        (2, 3, False, False),
        (2, 4, False, False),
        (2, 4, True, False),
        (4, 4, False, False),
        (16, 4, False, False),
        (1, 2, False, True),
        (2, 2, False, True),
        (2, 2, True, True),
        (4, 2, False, True),
        (4, 2, True, True),
    )
)
CANDIDATE_SETS = ("all", "pallas", "mosaic")


def _layout(
    shape: decode_bench.DecodeShape, num_tokens: int, k: int, alignment: int
) -> layouts.ContiguousLayout:
    """The contiguous layout (FP8 rows [M, k] with scales) of one decode batch."""
    _, _, topk_ids = decode_bench.make_tokens(shape, num_tokens)
    x = jax.random.normal(jax.random.PRNGKey(num_tokens), (num_tokens, k), jnp.float32)
    q, scales = quant.per_token_group_quant_fp8(x, 128)
    return layouts.permute_reference(
        q, topk_ids, num_experts=shape.num_experts, x_scales=scales, alignment=alignment
    )


def _weight_bytes(w: jax.Array, w_scales: jax.Array, expert_ids: jax.Array) -> int:
    """Bytes of the active experts' weights and float32 scales (what the GEMM must read)."""
    active = np.unique(np.asarray(expert_ids))
    active = active[active >= 0].size
    per_expert = math.prod(w.shape[1:]) * w.dtype.itemsize + math.prod(w_scales.shape[1:]) * 4
    return active * per_expert


def layer_alignment(shape: decode_bench.DecodeShape, num_tokens: int) -> int:
    """The segment multiple the layer's Pallas GEMM asks for at T tokens (16, 32 or 64)."""
    problem = grouped_gemm.GemmProblem(
        layout="contiguous",
        n=2 * shape.intermediate,
        k=shape.hidden,
        num_experts=shape.num_experts,
        num_pairs=num_tokens * shape.topk,
        x_dtype="float8_e4m3fn",
        w_dtype="float8_e4m3fn",
        platform="gpu",
    )
    return segment_alignment(grouped_gemm.GEMMS.get("pallas"), problem)


def heuristic_of(
    lay: layouts.ContiguousLayout, w: jax.Array, *, alignment: int
) -> gemm_kernels.GroupedGemmConfig:
    """The kernel's heuristic config for this layout and weights (as the "pallas" backend)."""
    return gemm_kernels.heuristic_config(
        num_rows=lay.rows.shape[0],
        num_experts=w.shape[0],
        n=w.shape[1],
        k=w.shape[2],
        alignment=alignment,
        is_fp8=True,
    )


def sweep_one(
    lay: layouts.ContiguousLayout,
    w: jax.Array,
    w_scales: jax.Array,
    *,
    samples: int,
    interpret: bool,
    burst: int = BURST,
    alignment: int = ALIGNMENT,
    candidates: str = "all",
) -> list[dict]:
    """Times the heuristic config and each of `CANDIDATES` on one contiguous-layout GEMM, and
    the Mosaic GPU kernel's `MOSAIC_CANDIDATES` where the layout and N allow them.

    Args:
      lay: float8_e4m3fn rows [M, K] sorted by expert in `alignment`-row segments, row scales
        float32[M, K/128] and expert_ids int32[M] (-1 on padding rows).
      w: float8_e4m3fn[E, N, K]; w_scales float32[E, N/128, K/128].
      samples: streamed samples (of `burst` calls) per config.
      interpret: Pallas interpret mode (off a GPU).
      burst: back-to-back calls per streamed sample (`moe_jax.cli.timing.BURST` by default).
      alignment: the layout's segment multiple.
      candidates: "pallas" (the Pallas kernel's candidates), "mosaic" (the Mosaic kernel's) or
        "all"; the heuristic is always timed.

    Returns:
      [{config, us, gbs, rel_to_heuristic}], best first; a config whose output differs from
      the heuristic's by more than `TOLERANCE`, or that fails to run, is {config, failed} at
      the end.
    """
    heuristic = heuristic_of(lay, w, alignment=alignment)
    configs = {"heuristic": heuristic}
    for changes in CANDIDATES if candidates in ("all", "pallas") else ():
        config = dataclasses.replace(heuristic, **changes)
        fits = w.shape[1] % config.block_n == 0 and alignment % config.block_m == 0
        if config != heuristic and fits:
            configs.setdefault(_describe(config), config)
    if candidates in ("all", "pallas") and heuristic.is_fp8_dot and w.dtype == quant.FP8_DTYPE:
        # The heuristic's tiles with the other FP8 accumulation (`GroupedGemmConfig.is_fp8_wgmma`:
        # Hopper's FP8 wgmma, or exact accumulation through mma.sync).
        other = dataclasses.replace(heuristic, is_fp8_wgmma=not heuristic.is_fp8_wgmma)
        configs.setdefault(_describe(other), other)

    if candidates in ("all", "mosaic") and w.dtype == quant.FP8_DTYPE:
        # the Mosaic kernel's own heuristic for this layout, named as such (added if no
        # candidate is it)
        mosaic_heuristic = mosaic_fp8_gemm.heuristic_config(
            num_rows=lay.rows.shape[0], num_experts=w.shape[0], k=w.shape[2]
        )
        for config in dict.fromkeys((*MOSAIC_CANDIDATES, mosaic_heuristic)):
            if alignment % mosaic_fp8_gemm.BLOCK_M == 0 and w.shape[1] % config.tile_n == 0:
                label = " [mosaic heuristic]" if config == mosaic_heuristic else ""
                configs[_describe(config) + label] = config

    def run(config):
        gemm = (
            mosaic_fp8_gemm.mosaic_fp8_gemm_contiguous
            if isinstance(config, mosaic_fp8_gemm.MosaicFp8GemmConfig)
            else gemm_kernels.grouped_gemm_contiguous
        )
        return jax.jit(
            lambda x, s, ids, w, ws: gemm(
                x,
                w,
                ids,
                x_scales=s,
                w_scales=ws,
                alignment=alignment,
                config=config,
                interpret=interpret,
            )
        )

    operands = (lay.rows, lay.row_scales, lay.expert_ids, w, w_scales)
    want = run(heuristic)(*operands)
    valid = np.asarray(lay.expert_ids) >= 0
    num_bytes = _weight_bytes(w, w_scales, lay.expert_ids)
    results = []
    for name, config in configs.items():
        fn = run(config)
        try:
            got = fn(*operands)
            error = rel_error(got[valid], want[valid])
            if error > TOLERANCE:
                results.append(dict(config=name, failed=f"differs from the heuristic: {error:.2e}"))
                continue
            timing = time_calls(
                lambda fn=fn: fn(*operands),
                wait=jax.block_until_ready,
                samples=samples,
                burst=burst,
            )
        except Exception as failure:  # noqa: BLE001 - e.g. shared memory: report, go on
            results.append(dict(config=name, failed=f"{type(failure).__name__}: {failure}"[:200]))
            continue
        us = timing.streamed_ms * 1e3
        results.append(dict(config=name, us=us, gbs=num_bytes / us / 1e3, rel_to_heuristic=error))
    results.sort(key=lambda r: r.get("us", float("inf")))
    return results


def _describe(config: Any) -> str:
    if isinstance(config, mosaic_fp8_gemm.MosaicFp8GemmConfig):
        return (
            f"mosaic bm{mosaic_fp8_gemm.BLOCK_M} bn{config.tile_n} {config.num_compute_wgs} wg "
            f"g{config.group_blocks} s{config.max_concurrent_steps}"
            f"{' chained' if config.is_chained else ''}"
            f"{' overlapped' if config.is_overlapped else ''}"
        )
    return (
        f"bm{config.block_m} bn{config.block_n} bk{config.block_k} w{config.num_warps} "
        f"s{config.num_stages}{' T' if config.is_transposed else ''}"
        f"{' cols first' if config.is_column_major else ''}"
        f"{' fp8 wgmma' if config.is_fp8_wgmma else ' exact acc' if config.is_fp8_dot else ''}"
    )


def _check_heuristic(
    lay: layouts.ContiguousLayout,
    w: jax.Array,
    w_scales: jax.Array,
    *,
    alignment: int,
    interpret: bool,
) -> float:
    """Rel. error of the heuristic's output against float32 on `CHECK_ROWS` valid rows spread
    over the layout (only their experts' weights are dequantized, so it fits for E=256)."""
    valid = np.flatnonzero(np.asarray(lay.expert_ids) >= 0)
    keep = valid[np.unique(np.linspace(0, valid.size - 1, CHECK_ROWS).astype(int))]
    got = gemm_kernels.grouped_gemm_contiguous(
        lay.rows,
        w,
        lay.expert_ids,
        x_scales=lay.row_scales,
        w_scales=w_scales,
        alignment=alignment,
        out_dtype=jnp.float32,
        interpret=interpret,
    )[keep]
    ids = lay.expert_ids[keep]
    x, x_scales = lay.rows, lay.row_scales
    rows = quant.dequant_per_token_group(x[keep], x_scales[keep])
    per_row = quant.dequant_per_block(w[ids], w_scales[ids])  # float32[rows, N, K]
    want = jnp.einsum("mk,mnk->mn", rows, per_row, precision=jax.lax.Precision.HIGHEST)
    return rel_error(got, want)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gemm_sweep", description=__doc__)
    parser.add_argument(
        "--tokens", type=int, nargs="+", help="token counts (default: 1 32 128 on a GPU, else 2)"
    )
    parser.add_argument(
        "--gemms", type=int, nargs="+", default=[1, 2], choices=[1, 2], help="which GEMMs"
    )
    parser.add_argument("--samples", type=int, default=5, help="streamed samples per config")
    parser.add_argument(
        "--burst", type=int, default=BURST, help="back-to-back calls per streamed sample"
    )
    parser.add_argument(
        "--shape",
        choices=sorted(decode_bench.SHAPES),
        help="expert shapes (default: deepseek_v3 on a GPU, else tiny)",
    )
    parser.add_argument(
        "--alignment",
        type=int,
        help="segment row multiple of the layout (a multiple of 16; default: the layer's own "
        "for each T, 16, 32 or 64 by pairs per expert)",
    )
    parser.add_argument(
        "--candidates",
        choices=CANDIDATE_SETS,
        default="all",
        help="which configs beside the heuristic: the Pallas kernel's, the Mosaic GPU FP8 "
        "kernel's (64-row segments only) or both",
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.burst < 1:
        parser.error(f"--samples {args.samples} --burst {args.burst}: pass positive counts")
    if args.alignment is not None and (args.alignment < 16 or args.alignment % 16):
        parser.error(f"--alignment {args.alignment}: pass a positive multiple of 16")
    on_gpu = jax.default_backend() == "gpu"
    shape = decode_bench.SHAPES[args.shape or ("deepseek_v3" if on_gpu else "tiny")]
    tokens = args.tokens or ([1, 32, 128] if on_gpu else [2])
    weights = decode_bench.make_weights(shape)
    gemm_operands = {
        1: (shape.hidden, weights.w1, weights.w1_scale),
        2: (shape.intermediate, weights.w2, weights.w2_scale),
    }
    report = []
    status = 0
    for num_tokens in tokens:
        alignment = args.alignment or layer_alignment(shape, num_tokens)
        for gemm in args.gemms:
            k, w, w_scales = gemm_operands[gemm]
            lay = _layout(shape, num_tokens, k, alignment)
            error = _check_heuristic(lay, w, w_scales, alignment=alignment, interpret=not on_gpu)
            heuristic = heuristic_of(lay, w, alignment=alignment)
            print(
                f"T={num_tokens} GEMM{gemm} [{lay.rows.shape[0]}, {k}] x {list(w.shape)}, "
                f"alignment {alignment}: heuristic ({_describe(heuristic)}) rel "
                f"error vs float32 {error:.2e}",
                flush=True,
            )
            entry = dict(tokens=num_tokens, gemm=gemm, alignment=alignment, rel_error=error)
            report.append(entry)
            if error > TOLERANCE:
                print(f"  above {TOLERANCE:.0e}: wrong results are not timed", file=sys.stderr)
                status = 1
                entry["results"] = []
                continue
            results = sweep_one(
                lay,
                w,
                w_scales,
                samples=args.samples,
                burst=args.burst,
                interpret=not on_gpu,
                alignment=alignment,
                candidates=args.candidates,
            )
            for r in results:
                if "failed" in r:
                    print(f"  {r['config']:<22} failed: {r['failed']}")
                else:
                    print(
                        f"  {r['config']:<22} {r['us']:9.1f} us {r['gbs']:7.0f} GB/s "
                        f"(vs heuristic {r['rel_to_heuristic']:.1e})",
                        flush=True,
                    )
            entry["results"] = results
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(shape=dataclasses.asdict(shape), alignment=args.alignment, report=report),
                f,
                indent=1,
            )
    return status


if __name__ == "__main__":
    raise SystemExit(main())
