"""`python -m benchmarks.stage_breakdown`: the time of each stage of moe_jax's FP8 forward.

    python -m benchmarks.stage_breakdown [--shapes A B] [--iters 20] [--json stages.json]

The stages are the public methods `fused_moe(experts="auto")` itself runs, in the order
`ContiguousExperts.apply` runs them: `NoEPPrepareFinalize.prepare` (FP8 quantization of x
through `moe_jax.act_quant.group_quant`), then `ContiguousExperts.arrange` (the permute, or the
route, the routing metadata alone, where GEMM1 reads its rows from the tokens:
`GemmPair.gathers_rows`), `first_gemm` and `activate` (or `first_gemm_act_quant`, one stage
where GEMM1 is fused with them), `second_gemm` and `unpermute`, each jitted alone and fed the
previous stage's real output. Beside them, the same forward in one jit (`bench`'s moe_jax_fp8
row) and the gap between it and the stages' sums.

Each stage gets two times: `ms`, the host clock per call streamed back to back (`time_jax`), and
on a GPU `device_ms`, the time its kernels ran per call (`kernel_gaps.device_busy_ms`). A small
stage alone is bound by the host's launch of its jit, so the host times' sum can exceed the
one-jit forward; the device times' sum is the forward's kernel work, and the forward's excess
over it is what lies between its kernels (`kernel_gaps` shows where).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

import jax

from benchmarks.kernel_gaps import device_busy_ms
from moe_jax import quant
from moe_jax.cli import layer_bench, layer_report
from moe_jax.cli.layer_bench import Layer
from moe_jax.cli.timing import time_jax
from moe_jax.contiguous_experts import ContiguousExperts
from moe_jax.experts import ExpertsCall, ExpertWeights
from moe_jax.experts_by_name import resolve_experts
from moe_jax.prepare_finalize import NoEPPrepareFinalize


def stage_breakdown(layer: Layer, *, iters: int, experts: str = "auto") -> list[dict]:
    """[{"stage": name, "ms": streamed median, "device_ms": device time per call or None}] for
    each stage of the FP8 forward of `layer` (`device_ms` None off a GPU).

    Args:
      layer: the benchmark's inputs (`moe_jax.cli.layer_bench.make_layer`).
      iters: as for `moe_jax.cli.timing.time_jax`.
      experts: the experts to break down (a name or object); only the contiguous layout has
        stage methods, so anything else returns [].
    """
    chosen = resolve_experts(experts)
    if not isinstance(chosen, ContiguousExperts):
        return []
    num_tokens, topk = layer.topk_ids.shape
    weights = ExpertWeights(w1=layer.w1q, w2=layer.w2q, w1_scale=layer.w1s, w2_scale=layer.w2s)
    quant_config = quant.Fp8BlockQuant()
    call = ExpertsCall(quant_config=quant_config, out_dtype=layer.x.dtype)
    gemms = chosen.plan_for(weights, num_tokens=num_tokens, topk=topk, x_dtype=quant.FP8_DTYPE)
    rows: list[dict] = []

    def timed(stage: str, fn: Callable, *args):
        jitted = jax.jit(fn)
        out = jitted(*args)
        rows.append(
            dict(
                stage=stage,
                ms=time_jax(jitted, args, iters=iters)[0],
                device_ms=device_busy_ms(jitted, args),
            )
        )
        return out

    prepared = timed(
        "quantize x",
        lambda x, tw, ti: NoEPPrepareFinalize().prepare(
            x, tw, ti, quant_config=quant_config, apply_router_weight_on_input=False
        ),
        layer.x,
        layer.topk_weights,
        layer.topk_ids,
    )
    lay = timed(
        "route" if gemms.gathers_rows else "permute",  # what `ContiguousExperts.arrange` runs
        lambda p, w: chosen.arrange(p, w, expert_map=None, plan=gemms),
        prepared,
        weights,
    )
    if gemms.fuses_act_quant:
        a, a_scales = timed(
            f"GEMM1 + act*up + quantize ({gemms.gemm1.name})",
            lambda lay, w, p: chosen.first_gemm_act_quant(
                lay, w, plan=gemms, call=call, prepared=p
            ),
            lay,
            weights,
            prepared,
        )
    else:
        h = timed(
            f"GEMM1 ({gemms.gemm1.name})",
            lambda lay, w: chosen.first_gemm(lay, w, plan=gemms, call=call),
            lay,
            weights,
        )
        a, a_scales = timed(
            "act*up + quantize", lambda h, lay: chosen.activate(h, call, lay, plan=gemms), h, lay
        )
    y = timed(
        f"GEMM2 ({gemms.gemm2.name})",
        lambda a, s, lay, w: chosen.second_gemm(a, s, lay, w, plan=gemms, call=call),
        a,
        a_scales,
        lay,
        weights,
    )
    timed(
        "unpermute + reduce",
        lambda y, lay, p: chosen.unpermute(y, lay, p, call, plan=gemms),
        y,
        lay,
        prepared,
    )
    return rows


def format_breakdown(shape: object, rows: list[dict], forward_ms: float | None = None) -> str:
    """The stage rows of `stage_breakdown`: each stage's host-clock ms and, where measured (a
    GPU), its device ms, with shares of the device sum (of the host sum where a stage has no
    device time). With `forward_ms` (the one-jit forward's ms, `bench`'s moe_jax_fp8 row) also
    the gap: the forward minus each sum. Against the host sum it is what the jit boundaries add
    or take away (negative where the stages alone wait on their launch); against the device
    sum, the time the forward spends beyond its kernels' work.

    Example:
      >>> rows = [dict(stage="a", ms=1.0, device_ms=0.5), dict(stage="b", ms=3.0, device_ms=1.5)]
      >>> print(format_breakdown("S", rows, 3.5))
      stages of moe_jax_fp8, shape S (each jitted alone)
        stage                                               host ms  device ms   share
        a                                                     1.000      0.500   25.0%
        b                                                     3.000      1.500   75.0%
        sum                                                   4.000      2.000
        forward (one jit)                                     3.500
        forward - sum                                        -0.500     +1.500
    """
    width = 48
    lines = [f"stages of moe_jax_fp8, shape {shape} (each jitted alone)"]
    if not rows:
        lines.append("  (experts='auto' is not the contiguous layout here: no stages to time)")
        return "\n".join(lines)
    lines.append(f"  {'stage':<{width}}    host ms  device ms   share")
    host_total = sum(r["ms"] for r in rows)
    device = [r.get("device_ms") for r in rows]
    device_total = None if None in device else sum(device)
    share_total = host_total if device_total is None else device_total

    def device_cell(ms: float | None, sign: str = "") -> str:
        return f"{'-':>10}" if ms is None else f"{ms:>{sign}10.3f}"

    for r, dev in zip(rows, device, strict=True):
        share = r["ms"] if device_total is None else dev
        lines.append(
            f"  {r['stage']:<{width}} {r['ms']:>10.3f} {device_cell(dev)} "
            f"{100 * share / share_total:6.1f}%"
        )
    lines.append(f"  {'sum':<{width}} {host_total:>10.3f} {device_cell(device_total)}")
    if forward_ms is not None:
        lines.append(f"  {'forward (one jit)':<{width}} {forward_ms:>10.3f}")
        device_gap = None if device_total is None else forward_ms - device_total
        lines.append(
            f"  {'forward - sum':<{width}} {forward_ms - host_total:>+10.3f} "
            f"{device_cell(device_gap, '+')}"
        )
    return "\n".join(lines)


def forward_ms(layer: Layer, *, iters: int) -> float:
    """The one-jit FP8 forward's streamed ms: `bench`'s moe_jax_fp8 row, timed the same way."""
    fn, args = layer_bench.jax_variant("moe_jax_fp8", layer)
    jax.block_until_ready(fn(*args))
    return time_jax(fn, args, iters=iters)[0]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.stage_breakdown", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        choices=sorted(layer_bench.SHAPES),
        help="bench's shapes (default: A B on a GPU, else small)",
    )
    parser.add_argument("--iters", type=int, default=20, help="as bench's --iters")
    parser.add_argument("--json", help="write {environment, shapes: {name: {forward_ms, stages}}}")
    args = parser.parse_args(argv)
    if args.iters < 1:
        parser.error(f"--iters {args.iters}: at least 1 timed call is needed")
    names = args.shapes or (["A", "B"] if jax.default_backend() == "gpu" else ["small"])
    results = {}
    for name in names:
        print(f"[{name}] stage breakdown", file=sys.stderr, flush=True)
        layer = layer_bench.make_layer(layer_bench.SHAPES[name])
        stages = stage_breakdown(layer, iters=args.iters)
        results[name] = dict(forward_ms=forward_ms(layer, iters=args.iters), stages=stages)
    env = layer_report.environment()
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    for name, result in results.items():
        shape = layer_bench.SHAPES[name]
        print(format_breakdown(shape, result["stages"], result["forward_ms"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=env, shapes=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
