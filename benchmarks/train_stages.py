"""`python -m benchmarks.train_stages`: the forward and the backward time of each stage of one
MoE training step.

The stages are the public methods `ContiguousExperts.apply` runs (`permute`, `first_gemm`,
`activate`, `second_gemm`, `unpermute`), each jitted alone and fed the previous stage's real
output. For each, "fwd ms" times the stage; "bwd ms" times its VJP alone, with respect to the
arrays the step differentiates there (tokens or rows, the stage's weight, router weights):
`jax.vjp` runs once, and the returned VJP function (a pytree holding the residuals) is jitted and
timed on a random cotangent. Their sums sit above the one-jit step by the launches and fusion
boundaries between the jits; the step's own times come from `moe_jax.cli.train_bench`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.cli.layer_bench import SHAPES, Layer, make_layer
from moe_jax.cli.timing import time_jax
from moe_jax.cli.train_bench import experts_for
from moe_jax.contiguous_experts import ContiguousExperts
from moe_jax.experts import ExpertsCall, ExpertWeights
from moe_jax.experts_by_name import resolve_experts
from moe_jax.prepare_finalize import PreparedTokens


def _cotangent(out, key):
    """A random cotangent for `out`'s float leaves, float0 zeros for its integer leaves."""
    leaves, tree = jax.tree.flatten(out)
    keys = jax.random.split(key, max(len(leaves), 1))
    cots = [
        jax.random.normal(k, leaf.shape, leaf.dtype)
        if jnp.issubdtype(leaf.dtype, jnp.floating)
        else np.zeros(leaf.shape, jax.dtypes.float0)
        for k, leaf in zip(keys, leaves, strict=False)
    ]
    return jax.tree.unflatten(tree, cots)


def stage_times(layer: Layer, *, iters: int, experts="auto") -> list[dict]:
    """[{"stage", "fwd ms", "bwd ms"}] for the bf16 training step of `layer` (streamed medians).

    Args:
      layer: inputs from `moe_jax.cli.layer_bench.make_layer` (its bf16 weights are used).
      iters: as for `moe_jax.cli.timing.time_jax`.
      experts: a name or object resolving to `ContiguousExperts` (only it has stage methods).
    """
    chosen = resolve_experts(experts)
    if not isinstance(chosen, ContiguousExperts):
        raise ValueError(f"experts={experts!r}: stage times need the contiguous layout")
    num_tokens, topk = layer.topk_ids.shape
    weights = ExpertWeights(w1=layer.w1, w2=layer.w2)
    call = ExpertsCall(quant_config=None, out_dtype=layer.x.dtype)
    prepared = PreparedTokens(
        x=layer.x, x_scales=None, topk_weights=layer.topk_weights, topk_ids=layer.topk_ids
    )
    gemms = chosen.plan_for(weights, num_tokens=num_tokens, topk=topk, x_dtype=layer.x.dtype)
    rows: list[dict] = []
    key = jax.random.PRNGKey(11)

    def timed(stage: str, fn: Callable, diff: tuple, rest: tuple = ()):
        """Times fn(*diff, *rest) and its VJP with respect to `diff` alone (as in the step:
        no cotangent is formed for index arrays or for weights a stage does not read)."""
        nonlocal key
        forward = jax.jit(fn)
        out = forward(*diff, *rest)
        fwd_ms = time_jax(forward, (*diff, *rest), iters=iters)[0]
        _, vjp = jax.jit(lambda d, r: jax.vjp(lambda *d: fn(*d, *r), *d))(diff, rest)
        key, sub = jax.random.split(key)
        backward = jax.jit(lambda vjp, cot: vjp(cot))
        bwd_ms = time_jax(backward, (vjp, _cotangent(out, sub)), iters=iters)[0]
        rows.append({"stage": stage, "fwd ms": fwd_ms, "bwd ms": bwd_ms})
        return out

    # The permute's VJP is timed on the rows alone (the index outputs take no cotangent); the
    # later stages get the whole layout.
    timed(
        "permute",
        lambda x, ids: (
            chosen.permute(
                dataclasses.replace(prepared, x=x, topk_ids=ids),
                weights,
                expert_map=None,
                plan=gemms,
            ).rows
        ),
        (layer.x,),
        (layer.topk_ids,),
    )
    lay = chosen.permute(prepared, weights, expert_map=None, plan=gemms)
    h = timed(
        f"GEMM1 ({gemms.gemm1.name})",
        lambda rows, w1, lay: chosen.first_gemm(
            dataclasses.replace(lay, rows=rows),
            dataclasses.replace(weights, w1=w1),
            plan=gemms,
            call=call,
        ),
        (lay.rows, weights.w1),
        (lay,),
    )
    a = timed("act*up", lambda h, lay: chosen.activate(h, call, lay, plan=gemms)[0], (h,), (lay,))
    y = timed(
        f"GEMM2 ({gemms.gemm2.name})",
        lambda a, w2, lay: chosen.second_gemm(
            a, None, lay, dataclasses.replace(weights, w2=w2), plan=gemms, call=call
        ),
        (a, weights.w2),
        (lay,),
    )
    timed(
        "unpermute + reduce",
        lambda y, topk_weights, lay: chosen.unpermute(
            y, lay, dataclasses.replace(prepared, topk_weights=topk_weights), call, plan=gemms
        ),
        (y, layer.topk_weights),
        (lay,),
    )
    rows.append(
        {
            "stage": "sum",
            "fwd ms": sum(r["fwd ms"] for r in rows),
            "bwd ms": sum(r["bwd ms"] for r in rows),
        }
    )
    return rows


def _table(rows: list[dict]) -> str:
    lines = ["| stage | fwd ms | bwd ms |", "|---|---|---|"]
    lines += [f"| {r['stage']} | {r['fwd ms']:.3f} | {r['bwd ms']:.3f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="B", choices=sorted(SHAPES))
    parser.add_argument(
        "--experts", default="auto", help="a train_bench variant on the contiguous layout"
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", help="write the rows here as JSON")
    opts = parser.parse_args(argv)
    layer = make_layer(SHAPES[opts.shape])
    rows = stage_times(layer, iters=opts.iters, experts=experts_for(opts.experts))
    print(f"shape {SHAPES[opts.shape]}; experts={opts.experts}; {jax.devices()[0].device_kind}")
    print(_table(rows))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"shape": opts.shape, "experts": opts.experts, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
