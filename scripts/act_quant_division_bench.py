"""Checks and times the FP8 quantization kernels' two divisions on a GPU (a development tool).

    python3 scripts/act_quant_division_bench.py                  # shapes A and B, on the GPU
    python3 scripts/act_quant_division_bench.py --shapes B --samples 30
    python3 scripts/act_quant_division_bench.py --shapes tiny --interpret   # CPU smoke run

For `group_quant` (the layer's tokens [T, H]) and `act_and_quant` (GEMM1's output [M, 2I]) at
each shape, with the heuristic config and `ActQuantConfig.division` "reciprocal" (one reciprocal
per row, FMAs per element: the default) and "div_rn" (PTX div.rn.f32 per element, as before):

- bitwise: the two divisions give the same FP8 bytes and scales, on random rows and on edge
  rows (zeros of both signs, subnormals, inf, NaN, amax from 2**-149 to 2**127). group_quant
  equals the XLA reference (`moe_jax.quant.per_token_group_quant_fp8`) bit for bit; act_and_quant
  equals the reference (`moe_jax.activation.act_and_mul`, then the quantization) bit for bit
  where the activation is exact (gate 0 or >= 20: silu(g) = g), and on random rows within one
  FP8 step on at most 1% of codes (Triton's exp and silu division are not XLA's; the tests say
  the same). The references run on the CPU device, where XLA divides correctly rounded.
- time: `moe_jax.cli.timing.time_calls` (host clock around block_until_ready), the median of
  `--samples` samples of `--burst` back-to-back calls; the divisions alternate for `--rounds`
  rounds in this process and each reports the median of its round medians.

Prints a table and one JSON line per (kernel, shape, division); exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import activation, quant
from moe_jax.cli.timing import time_calls
from moe_jax.kernels import act_quant as kernels

# (rows, columns) of group_quant's x and act_and_quant's h = [gate | up] (I = columns / 2).
SHAPES = {
    "A": {"group_quant": (4096, 7168), "act_and_quant": (36832, 4096)},
    "B": {"group_quant": (8192, 2048), "act_and_quant": (81792, 1536)},
    "tiny": {"group_quant": (64, 256), "act_and_quant": (96, 512)},
}
DIVISIONS = ("reciprocal", "div_rn")


def _reference(name: str, x: jax.Array):
    """The XLA recipe on the CPU device (correctly rounded float32 division)."""
    cpu = jax.devices("cpu")[0]

    def fn(v):
        a = activation.act_and_mul(v) if name == "act_and_quant" else v
        return quant.per_token_group_quant_fp8(a)

    with jax.default_device(cpu):
        return jax.jit(fn)(jax.device_put(x, cpu))


def _bits(out) -> tuple[np.ndarray, np.ndarray]:
    q, scales = out
    return np.asarray(q).view(np.uint8), np.asarray(scales).view(np.uint32)


def _same_bits(got, want) -> bool:
    return all(np.array_equal(g, w) for g, w in zip(_bits(got), _bits(want), strict=True))


def _within_one_step(got, want) -> tuple[bool, float]:
    """(every code within one e4m3 step and at most 1% of them different, that fraction)."""
    codes, codes_ref = (np.asarray(o[0]).astype(np.float32) for o in (got, want))
    step = 0.125 * np.abs(codes_ref) + 2.0**-9
    flips = float(np.mean(codes != codes_ref))
    return bool(np.all(np.abs(codes - codes_ref) <= step)) and flips <= 0.01, flips


def _edge_rows(rng, rows: int, cols: int) -> np.ndarray:
    shape = (rows, cols // 128, 128)
    magnitude = 2.0 ** rng.uniform(-149, 127, (rows, cols // 128, 1))
    spread = 2.0 ** np.where(rng.random(shape) < 0.3, -rng.uniform(0, 60, shape), 0)
    x = (rng.standard_normal(shape) * magnitude * spread).reshape(rows, cols)
    x = np.clip(x, -np.finfo(np.float32).max, np.finfo(np.float32).max)
    special = rng.random(x.shape)
    x[special < 0.03] = 0.0
    x[(special >= 0.03) & (special < 0.06)] = -0.0
    x[(special >= 0.06) & (special < 0.09)] = 2.0**-140
    x[0, 5], x[1, 130], x[2, cols - 3], x[3, 7] = np.inf, -np.inf, np.nan, -(2.0**-149)
    return x


def _inputs(name: str, rows: int, cols: int, rng) -> dict[str, jax.Array]:
    random = rng.standard_normal((rows, cols)) * 4.0
    inputs = {"random": random, "edge": _edge_rows(rng, min(rows, 256), cols)}
    if name == "act_and_quant":  # silu(g) == g exactly for g >= 20, and silu(0) == 0
        gate = rng.uniform(20.0, 40.0, (rows, cols // 2))
        gate[rng.random(gate.shape) < 0.25] = 0.0
        inputs["exact_act"] = np.concatenate([gate, random[:, cols // 2 :]], axis=1)
    return {k: jnp.asarray(v, jnp.bfloat16) for k, v in inputs.items()}


def _check(name: str, fns: dict, inputs: dict) -> list[tuple[str, bool, str]]:
    """(check, passed, detail) for one kernel at one shape."""
    results = []
    for kind, x in inputs.items():
        outs = {d: fns[d](x) for d in DIVISIONS}
        results.append((f"{kind}: reciprocal == div_rn", _same_bits(*outs.values()), ""))
        if kind == "edge":
            continue  # the kernels turn NaN into -448 (NaN-ignoring max), XLA keeps NaN
        want = _reference(name, x)
        if name == "group_quant" or kind == "exact_act":
            results.append((f"{kind}: == XLA reference", _same_bits(outs["reciprocal"], want), ""))
        else:
            ok, flips = _within_one_step(outs["reciprocal"], want)
            results.append((f"{kind}: <= 1 step of XLA", ok, f"{flips:.2e} of codes differ"))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["A", "B"], choices=sorted(SHAPES))
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--burst", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    args = parser.parse_args(argv)
    print(f"devices: {jax.devices()}")
    rng = np.random.default_rng(0)
    failed = False
    table = []
    for shape in args.shapes:
        for name, (rows, cols) in SHAPES[shape].items():
            kernel = getattr(kernels, name)
            groups = cols // 128 // (2 if name == "act_and_quant" else 1)
            base = kernels.heuristic_config(rows, groups)
            fns = {
                d: jax.jit(
                    functools.partial(
                        kernel,
                        config=dataclasses.replace(base, division=d),
                        interpret=args.interpret,
                    )
                )
                for d in DIVISIONS
            }
            inputs = _inputs(name, rows, cols, rng)
            for check, ok, detail in _check(name, fns, inputs):
                failed |= not ok
                print(f"{'ok  ' if ok else 'FAIL'} {name} {shape} [{rows}x{cols}] {check} {detail}")
            x = inputs["random"]
            rounds = {d: [] for d in DIVISIONS}
            for _ in range(args.rounds):
                for d in DIVISIONS:
                    timing = time_calls(
                        functools.partial(fns[d], x),
                        wait=jax.block_until_ready,
                        samples=args.samples,
                        burst=args.burst,
                    )
                    rounds[d].append(timing.streamed_ms * 1e3)
            out_bytes = rows * (cols // (2 if name == "act_and_quant" else 1)) * (1 + 4 / 128)
            for d in DIVISIONS:
                us = statistics.median(rounds[d])
                row = {
                    "kernel": name,
                    "shape": shape,
                    "rows": rows,
                    "cols": cols,
                    "division": d,
                    "us": round(us, 2),
                    "round_us": [round(v, 2) for v in rounds[d]],
                    "gb_per_s": round((x.nbytes + out_bytes) / us / 1e3, 1),
                    "samples": args.samples,
                    "burst": args.burst,
                }
                table.append(row)
                print(json.dumps(row))
    print(f"\n{'kernel':<14} {'shape':<5} {'division':<11} {'us':>9} {'GB/s':>7} {'vs div_rn':>9}")
    for row in table:
        old = next(
            r["us"]
            for r in table
            if (r["kernel"], r["shape"], r["division"]) == (row["kernel"], row["shape"], "div_rn")
        )
        print(
            f"{row['kernel']:<14} {row['shape']:<5} {row['division']:<11} {row['us']:>9.1f} "
            f"{row['gb_per_s']:>7.1f} {old / row['us']:>8.2f}x"
        )
    print("\nall checks passed" if not failed else "\nSOME CHECKS FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
