"""`python -m moe_jax.cli.gemm_sweep`: tile sweep of the Pallas decode grouped GEMM.

For each token count T it builds the contiguous layout (alignment 16) of a decode batch routed
like `bench --decode` (DeepSeek-V3 on one GPU by default), then times
`moe_jax.kernels.grouped_gemm_contiguous` for GEMM1 ([M, H] x [E, 2I, H]) and GEMM2
([M, I] x [E, H, I]) with the heuristic's tiles and each candidate of `CANDIDATES`. Every
candidate is checked first against the heuristic's output, and the heuristic's output against
the float32 reference on the first 16 rows (both within `TOLERANCE`; a config that is not is
reported, not timed, and a wrong heuristic makes the command exit with status 1). It prints,
per T and GEMM, each config's streamed microseconds and its weight-read bandwidth (the active
experts' FP8 weights and scales over the time), best first:

    python -m moe_jax.cli.gemm_sweep --tokens 1 32 128 --json sweep.json

This is the evidence behind `moe_jax.kernels.grouped_gemm.heuristic_config`. Without a GPU it
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

from moe_jax import layouts, quant
from moe_jax.cli import decode_bench
from moe_jax.cli.timing import rel_error, time_calls
from moe_jax.kernels import grouped_gemm as gemm_kernels

ALIGNMENT = 16
CHECK_ROWS = 16
# Relative error allowed against float32 (heuristic) and against the heuristic (candidates):
# bf16 output rounding plus Hopper's FP8 MMA, whose 128-wide block sums depend on the tiling.
TOLERANCE = 1e-2
# (block_n, block_k, num_warps, num_stages, is_transposed) around the heuristic's choices.
CANDIDATES = (
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


def _layout(
    shape: decode_bench.DecodeShape, num_tokens: int, k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(rows fp8[M, k], row_scales float32[M, k/128], expert_ids int32[M]) of one decode batch."""
    _, _, topk_ids = decode_bench.make_tokens(shape, num_tokens)
    x = jax.random.normal(jax.random.PRNGKey(num_tokens), (num_tokens, k), jnp.float32)
    q, scales = quant.per_token_group_quant_fp8(x, 128)
    lay = layouts.permute_reference(
        q, topk_ids, num_experts=shape.num_experts, x_scales=scales, alignment=ALIGNMENT
    )
    return lay.rows, lay.row_scales, lay.expert_ids


def _weight_bytes(w: jax.Array, w_scales: jax.Array, expert_ids: jax.Array) -> int:
    """Bytes of the active experts' weights and float32 scales (what the GEMM must read)."""
    active = np.unique(np.asarray(expert_ids))
    active = active[active >= 0].size
    per_expert = math.prod(w.shape[1:]) * w.dtype.itemsize + math.prod(w_scales.shape[1:]) * 4
    return active * per_expert


def sweep_one(
    x: jax.Array,
    x_scales: jax.Array,
    expert_ids: jax.Array,
    w: jax.Array,
    w_scales: jax.Array,
    *,
    samples: int,
    interpret: bool,
) -> list[dict]:
    """Times the heuristic config and each of `CANDIDATES` on one contiguous-layout GEMM.

    Args:
      x: float8_e4m3fn[M, K] rows sorted by expert in 16-row segments; x_scales float32[M, K/128].
      expert_ids: int32[M], -1 on padding rows.
      w: float8_e4m3fn[E, N, K]; w_scales float32[E, N/128, K/128].
      samples: streamed samples (of `timing.BURST` calls) per config.
      interpret: Pallas interpret mode (off a GPU).

    Returns:
      [{config, us, gbs, rel_to_heuristic}], best first; a config whose output differs from the
      heuristic's by more than `TOLERANCE`, or that fails to run, is {config, failed} at the end.
    """
    heuristic = gemm_kernels.heuristic_config(
        num_rows=x.shape[0],
        num_experts=w.shape[0],
        n=w.shape[1],
        k=w.shape[2],
        alignment=ALIGNMENT,
        is_fp8=True,
    )
    configs = [("heuristic", heuristic)]
    for block_n, block_k, warps, stages, transposed in CANDIDATES:
        config = dataclasses.replace(
            heuristic,
            block_n=block_n,
            block_k=block_k,
            num_warps=warps,
            num_stages=stages,
            is_transposed=transposed,
        )
        if config != heuristic and w.shape[1] % block_n == 0:
            configs.append((_describe(config), config))

    def run(config):
        return jax.jit(
            lambda x, s, ids, w, ws: gemm_kernels.grouped_gemm_contiguous(
                x,
                w,
                ids,
                x_scales=s,
                w_scales=ws,
                alignment=ALIGNMENT,
                config=config,
                interpret=interpret,
            )
        )

    operands = (x, x_scales, expert_ids, w, w_scales)
    want = run(heuristic)(*operands)
    valid = np.asarray(expert_ids) >= 0
    num_bytes = _weight_bytes(w, w_scales, expert_ids)
    results = []
    for name, config in configs:
        fn = run(config)
        try:
            got = fn(*operands)
            error = rel_error(got[valid], want[valid])
            if error > TOLERANCE:
                results.append(dict(config=name, failed=f"differs from the heuristic: {error:.2e}"))
                continue
            timing = time_calls(
                lambda fn=fn: fn(*operands), wait=jax.block_until_ready, samples=samples
            )
        except Exception as failure:  # noqa: BLE001 - e.g. shared memory: report, go on
            results.append(dict(config=name, failed=f"{type(failure).__name__}: {failure}"[:200]))
            continue
        us = timing.streamed_ms * 1e3
        results.append(dict(config=name, us=us, gbs=num_bytes / us / 1e3, rel_to_heuristic=error))
    results.sort(key=lambda r: r.get("us", float("inf")))
    return results


def _describe(config: Any) -> str:
    return (
        f"bn{config.block_n} bk{config.block_k} w{config.num_warps} s{config.num_stages}"
        f"{' T' if config.is_transposed else ''}"
    )


def _check_heuristic(
    x: jax.Array,
    x_scales: jax.Array,
    expert_ids: jax.Array,
    w: jax.Array,
    w_scales: jax.Array,
    *,
    interpret: bool,
) -> float:
    """Rel. error of the heuristic's output against float32 on the first valid rows (only
    their experts' weights are dequantized, so it fits for E=256)."""
    keep = np.flatnonzero(np.asarray(expert_ids) >= 0)[:CHECK_ROWS]
    got = gemm_kernels.grouped_gemm_contiguous(
        x,
        w,
        expert_ids,
        x_scales=x_scales,
        w_scales=w_scales,
        alignment=ALIGNMENT,
        out_dtype=jnp.float32,
        interpret=interpret,
    )[keep]
    ids = expert_ids[keep]
    rows = quant.dequant_per_token_group(x[keep], x_scales[keep])
    per_row = quant.dequant_per_block(w[ids], w_scales[ids])  # float32[rows, N, K]
    want = jnp.einsum("mk,mnk->mn", rows, per_row, precision=jax.lax.Precision.HIGHEST)
    return rel_error(got, want)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_jax.cli.gemm_sweep", description=__doc__)
    parser.add_argument(
        "--tokens", type=int, nargs="+", help="token counts (default: 1 32 128 on a GPU, else 2)"
    )
    parser.add_argument(
        "--gemms", type=int, nargs="+", default=[1, 2], choices=[1, 2], help="which GEMMs"
    )
    parser.add_argument("--samples", type=int, default=5, help="streamed samples per config")
    parser.add_argument(
        "--shape",
        choices=sorted(decode_bench.SHAPES),
        help="expert shapes (default: deepseek_v3 on a GPU, else tiny)",
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
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
        for gemm in args.gemms:
            k, w, w_scales = gemm_operands[gemm]
            x, x_scales, ids = _layout(shape, num_tokens, k)
            error = _check_heuristic(x, x_scales, ids, w, w_scales, interpret=not on_gpu)
            print(
                f"T={num_tokens} GEMM{gemm} [{x.shape[0]}, {k}] x {list(w.shape)}: heuristic rel "
                f"error vs float32 {error:.2e}",
                flush=True,
            )
            if error > TOLERANCE:
                print(f"  above {TOLERANCE:.0e}: wrong results are not timed", file=sys.stderr)
                status = 1
                report.append(dict(tokens=num_tokens, gemm=gemm, rel_error=error, results=[]))
                continue
            results = sweep_one(
                x, x_scales, ids, w, w_scales, samples=args.samples, interpret=not on_gpu
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
            report.append(dict(tokens=num_tokens, gemm=gemm, rel_error=error, results=results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(shape=dataclasses.asdict(shape), report=report), f, indent=1)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
