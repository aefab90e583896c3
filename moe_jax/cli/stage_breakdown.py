"""`python -m moe_jax bench --breakdown`: the time of each stage of moe_jax's FP8 forward.

The stages are the public methods `fused_moe(experts="auto")` itself runs, in the order
`ContiguousExperts.apply` runs them: `NoEPPrepareFinalize.prepare` (FP8 quantization of x
through `moe_jax.act_quant.group_quant`), then `ContiguousExperts.arrange` (the permute, or the
route, the routing metadata alone, where GEMM1 reads its rows from the tokens:
`GemmPair.gathers_rows`), `first_gemm` and `activate` (or `first_gemm_act_quant`, one stage
where GEMM1 is fused with them), `second_gemm` and `unpermute`, each jitted alone and fed the
previous stage's real output.

Each stage gets two times: `ms`, the host clock per call streamed back to back (`time_jax`), and
on a GPU `device_ms`, the time its kernels ran per call (`kernel_gaps.device_busy_ms`). A small
stage alone is bound by the host's launch of its jit (about 0.1 ms a call on the H100 host,
2026-12-07: quantize x took 0.108 ms by the host clock for some 0.02 ms of kernels), so the host
times' sum can exceed the one-jit forward; the device times' sum is the forward's kernel work,
and the forward's excess over it is what lies between its kernels (`kernel_gaps` shows where).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from moe_jax import quant
from moe_jax.cli.kernel_gaps import device_busy_ms
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
    gemms = chosen.select_gemms(weights, num_tokens=num_tokens, topk=topk, x_dtype=quant.FP8_DTYPE)
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
        lambda p, w: chosen.arrange(p, w, expert_map=None, gemms=gemms),
        prepared,
        weights,
    )
    if gemms.fuses_act_quant:
        a, a_scales = timed(
            f"GEMM1 + act*up + quantize ({gemms.gemm1.name})",
            lambda lay, w, p: chosen.first_gemm_act_quant(
                lay, w, gemms=gemms, call=call, prepared=p
            ),
            lay,
            weights,
            prepared,
        )
    else:
        h = timed(
            f"GEMM1 ({gemms.gemm1.name})",
            lambda lay, w: chosen.first_gemm(lay, w, gemms=gemms, call=call),
            lay,
            weights,
        )
        a, a_scales = timed(
            "act*up + quantize", lambda h, lay: chosen.activate(h, call, lay, gemms=gemms), h, lay
        )
    y = timed(
        f"GEMM2 ({gemms.gemm2.name})",
        lambda a, s, lay, w: chosen.second_gemm(a, s, lay, w, gemms=gemms, call=call),
        a,
        a_scales,
        lay,
        weights,
    )
    timed(
        "unpermute + reduce",
        lambda y, lay, p: chosen.unpermute(y, lay, p, call),
        y,
        lay,
        prepared,
    )
    return rows
