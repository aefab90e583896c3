"""`python -m benchmarks.gather_bench`: the layer's front half with the gathered fused GEMM1
against the same with the permute and the contiguous fused GEMM1, alone, at `bench`'s shapes.

The two forms are what `ContiguousExperts(alignment=128, fused_act_quant=...)` runs before
GEMM2, on the same FP8 tokens (`moe_jax.quant.per_token_group_quant_fp8` of `bench`'s layer,
its top-k ids and block-quantized w1):

    permuted   `ContiguousExperts.permute` (the routing metadata and the FP8 row copy), then
               `first_gemm_act_quant` with "mosaic_fp8" (what "auto" runs at shape B)
    gathered   `ContiguousExperts.route` (the metadata only), then `first_gemm_act_quant` with
               "mosaic_fp8_gathered" reading the rows from the tokens

Each form's FP8 codes and scales must equal the other's bit for bit on the layout's valid rows
before anything is timed (exit status 1 otherwise). Then rounds alternate the forms, each
round timing every form as streamed samples of back-to-back jitted calls
(`moe_jax.cli.timing.time_calls`); it prints each round's microseconds per call and the ratio
gathered / permuted, then the medians over the rounds. The rounds matter: a GPU's figures drift
by several percent over a run (BENCHMARKS.md, "Prefill", 2026-12-06), so only same-round ratios
compare.

    python -m benchmarks.gather_bench --shapes B --rounds 8 [--json gather.json]

Besides `bench`'s shapes, `--shapes` takes shape B varied one size at a time (`VARIED_B`):
B_h1024 (H=1024), B_t2048 (T=2048), B_i1024 / B_i1536 / B_i2048 (I=1024 / 1536 / 2048: GEMM1's
N = 2I from 2048 to 4096 at B's tokens and experts), B_e32 (T=4096, E=32, I=2048), where "auto"
fuses GEMM1 too: where the gathered form's bound on N (`GATHERED_MAX_N` of `moe_jax.plan`) comes
from.

Without a GPU both forms run their interpret-mode twins ("_interpret": the gathered one is its
reference, XLA's gather and the contiguous kernel), on the "tiny" shape by default: a check of
the command, not a timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
from collections.abc import Callable, Sequence

import jax
import numpy as np

from moe_jax import permute, quant
from moe_jax.cli import layer_bench
from moe_jax.cli.timing import BURST, time_calls
from moe_jax.contiguous_experts import ContiguousExperts
from moe_jax.experts import ExpertsCall, ExpertWeights
from moe_jax.prepare_finalize import PreparedTokens

ALIGNMENT = 128  # the gathered kernel's segments: whole pairs of 64-row blocks
# beside `bench`'s: shape B varied one size at a time, within where "auto" fuses GEMM1 (H up to
# `moe_jax.plan`'s `FUSED_ACT_QUANT_MAX_K`) and where its fused-GEMM1 rule was timed (BENCHMARKS.md,
# "Prefill", 2026-12-05): what "auto" taking the gathered form would change besides shape B
VARIED_B = {
    "B_h1024": dict(hidden=1024),
    "B_t2048": dict(num_tokens=2048),
    "B_i1024": dict(intermediate=1024),
    "B_i1536": dict(intermediate=1536),
    "B_i2048": dict(intermediate=2048),
    "B_e32": dict(num_tokens=4096, num_experts=32, intermediate=2048),
}
SHAPES = {
    **layer_bench.SHAPES,
    **{
        name: dataclasses.replace(layer_bench.SHAPES["B"], name=name, **changes)
        for name, changes in VARIED_B.items()
    },
    "tiny": layer_bench.BenchShape(
        name="tiny", num_tokens=8, num_experts=2, topk=1, hidden=128, intermediate=128
    ),
}
FORMS = ("permuted", "gathered")
FUSED_BACKENDS = {"permuted": "mosaic_fp8", "gathered": "mosaic_fp8_gathered"}


def front_halves(
    shape: layer_bench.BenchShape, *, interpret: bool, seed: int = 0
) -> tuple[dict[str, Callable[[], tuple[jax.Array, jax.Array]]], np.ndarray]:
    """Both forms of `shape`'s front half as jitted calls without arguments, each returning
    (float8_e4m3fn [M, I], float32 [M, I/128]), and the layout's valid rows (bool [M])."""
    layer = layer_bench.make_layer(shape, seed)
    x, x_scales = jax.jit(quant.per_token_group_quant_fp8)(layer.x)
    prepared = PreparedTokens(
        x=x, x_scales=x_scales, topk_ids=layer.topk_ids, topk_weights=layer.topk_weights
    )
    weights = ExpertWeights(w1=layer.w1q, w2=layer.w2q, w1_scale=layer.w1s, w2_scale=layer.w2s)
    call = ExpertsCall(quant_config=quant.Fp8BlockQuant())
    calls = {}
    for form in FORMS:
        fused = FUSED_BACKENDS[form]
        if interpret:  # the interpret twins are no registered backends: objects
            from moe_jax.kernels.mosaic_fp8_gemm import MosaicFp8FusedGemm1

            fused = MosaicFp8FusedGemm1(interpret=True, gathers_rows=form == "gathered")
        experts = ContiguousExperts(
            gemm="xla" if interpret else "auto", alignment=ALIGNMENT, fused_act_quant=fused
        )
        gemms = experts.plan_for(
            weights, num_tokens=shape.num_tokens, topk=shape.topk, x_dtype=quant.FP8_DTYPE
        )
        if not gemms.fuses_act_quant or gemms.gathers_rows != (form == "gathered"):
            raise RuntimeError(f"{form}: {gemms} is not the fused GEMM1 this form times")

        def front(experts=experts, gemms=gemms):
            lay = experts.arrange(prepared, weights, expert_map=None, plan=gemms)
            return experts.first_gemm_act_quant(
                lay, weights, plan=gemms, call=call, prepared=prepared
            )

        calls[form] = jax.jit(front)
    lay = permute.route(layer.topk_ids, num_experts=shape.num_experts, alignment=ALIGNMENT)
    return calls, np.asarray(lay.expert_ids) >= 0


def check_equal(
    calls: dict[str, Callable[[], tuple[jax.Array, jax.Array]]], valid: np.ndarray
) -> str | None:
    """None when every form's codes and scales equal the first form's on the valid rows, else
    what differs."""
    first, *others = FORMS
    q0, s0 = (np.asarray(a) for a in calls[first]())
    for form in others:
        q, s = (np.asarray(a) for a in calls[form]())
        if q.shape != q0.shape or s.shape != s0.shape:
            return f"{form}: shapes {q.shape} {s.shape} against {first}'s {q0.shape} {s0.shape}"
        codes = q.view(np.uint8)[valid] != q0.view(np.uint8)[valid]
        scales = s[valid] != s0[valid]
        if codes.any() or scales.any():
            return (
                f"{form}: {int(codes.any(axis=1).sum())} rows of codes and "
                f"{int(scales.any(axis=1).sum())} of scales differ from {first}'s "
                f"(of {int(valid.sum())} valid rows)"
            )
    return None


def run_rounds(
    calls: dict[str, Callable[[], tuple[jax.Array, jax.Array]]],
    *,
    rounds: int,
    samples: int,
    burst: int,
    report: Callable[[str], None] = print,
) -> list[dict[str, float]]:
    """`rounds` rounds, each timing every form in turn: per round, us per call of each form and
    the ratio gathered / permuted."""
    results = []
    for number in range(1, rounds + 1):
        row = {}
        for form in FORMS:
            timing = time_calls(
                calls[form], wait=jax.block_until_ready, samples=samples, burst=burst
            )
            row[form] = timing.streamed_ms * 1e3
        row["ratio"] = row["gathered"] / row["permuted"]
        results.append(row)
        report(
            f"  round {number}/{rounds}: permuted {row['permuted']:.1f} us, gathered "
            f"{row['gathered']:.1f} us, gathered / permuted {row['ratio']:.3f}"
        )
    return results


def summary(results: Sequence[dict[str, float]]) -> dict[str, float]:
    """Medians over the rounds, and in how many the gathered form was the faster."""
    return {
        "permuted_us": statistics.median(r["permuted"] for r in results),
        "gathered_us": statistics.median(r["gathered"] for r in results),
        "ratio": statistics.median(r["ratio"] for r in results),
        "gathered_faster_rounds": sum(r["ratio"] < 1 for r in results),
        "rounds": len(results),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gather_bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--shapes", nargs="+", choices=sorted(SHAPES), help="default: B on a GPU, tiny elsewhere"
    )
    parser.add_argument("--rounds", type=int, default=8, help="alternating rounds (default 8)")
    parser.add_argument(
        "--samples", type=int, default=3, help="streamed samples per form and round"
    )
    parser.add_argument("--burst", type=int, default=BURST, help="back-to-back calls per sample")
    parser.add_argument("--json", help="write the rounds and medians here")
    args = parser.parse_args(argv)
    for name in ("rounds", "samples", "burst"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    on_gpu = jax.default_backend() == "gpu"
    shapes = args.shapes or (["B"] if on_gpu else ["tiny"])
    report = functools.partial(print, flush=True)
    out = {"backend": jax.default_backend(), "jax": jax.__version__, "shapes": {}}
    if on_gpu:
        out["device"] = jax.devices()[0].device_kind
    status = 0
    for name in shapes:
        shape = SHAPES[name]
        report(f"[{shape}] building the tokens, the weights and both forms")
        calls, valid = front_halves(shape, interpret=not on_gpu)
        mismatch = check_equal(calls, valid)
        if mismatch is not None:
            report(f"  NOT EQUAL, not timed: {mismatch}")
            out["shapes"][name] = {"mismatch": mismatch}
            status = 1
            continue
        report(f"  codes and scales equal bit for bit on {int(valid.sum())} valid rows")
        results = run_rounds(
            calls, rounds=args.rounds, samples=args.samples, burst=args.burst, report=report
        )
        medians = summary(results)
        report(
            f"  medians: permuted {medians['permuted_us']:.1f} us, gathered "
            f"{medians['gathered_us']:.1f} us, ratio {medians['ratio']:.3f}; gathered faster "
            f"in {medians['gathered_faster_rounds']} of {medians['rounds']} rounds"
        )
        out["shapes"][name] = {"per_round": results, **medians}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
