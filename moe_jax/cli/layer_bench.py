"""`python -m moe_jax bench`: whole-layer forward times against baselines, checked, in one table.

Every variant runs the same routed layer (random tokens, softmax top-k routing) and is checked
against a float32 reference on the same weights before it is timed. Times come from
`moe_jax.cli.timing` (the one timing loop): "ms" is the median per-call time of bursts of
back-to-back calls (a layer inside a model whose host runs ahead), "latency ms" the median of
single waited-for calls, "1st call s" the wall time of a JAX variant's first call (tracing and
compilation included, DeepGEMM's JIT too where its cache lacks the shape: the wait a notebook
user sees; a program this process compiled before is not compiled again). TFLOPS count the
routed work only: 6 * T * k * H * I.

Variants (each runs where it can; the table says why one did not):
  jax_ragged_dot_bf16   argsort + jax.lax.ragged_dot (what a JAX user writes today)
  jax_mosaic_bf16       argsort + JAX's Mosaic GPU ragged_dot kernel (GPU)
  torch_deep_gemm_fp8   torch glue (sort, index, quantize in torch ops) + DeepGEMM FP8 (GPU)
  tokamax, tokamax_mosaic, tokamax_triton
                        argsort + tokamax.ragged_dot, bf16, its default implementation, then
                        "mosaic" and "triton" (GPU) (`moe_jax.cli.tokamax_peer`; the peers extra)
  moe_jax_bf16          fused_moe(experts="auto") on bf16 weights
  moe_jax_fp8           fused_moe(experts="auto") on FP8 block weights (on a Hopper GPU with
                        H <= 2048 its GEMM1 is the fused one below, in its gathered form where
                        GEMM1's N <= 1536 on jax 0.11 or later, `ContiguousExperts`)
  moe_jax_fp8_unfused   the same with GEMM1 and the act + quantization kernel apart
                        (`ContiguousExperts(fused_act_quant=None)`; runs only when named)
  moe_jax_fp8_graph     DeepGEMM for both GEMMs (never fused) with calls XLA may capture into a
                        CUDA graph (`DeepGemmConfig(command_buffer_compatible=True)`; GPU; runs
                        only when named in --variants, best with
                        XLA_FLAGS=--xla_gpu_graph_min_graph_size=1 set before the process starts)
  moe_jax_fp8_fused_act FP8 with GEMM1, act(gate) * up and the quantization in one Mosaic GPU
                        kernel at every H (`ContiguousExperts(fused_act_quant="mosaic_fp8")`,
                        128-row segments; Hopper; runs only when named in --variants)
  moe_jax_fp8_fused_act_graph
                        both: the fused GEMM1 and a GEMM2 XLA may capture (only when named;
                        the XLA_FLAGS above apply)
  moe_jax_fp8_gathered  the fused GEMM1 reading its rows from the tokens, no permuted copy
                        (`ContiguousExperts(fused_act_quant="mosaic_fp8_gathered")`, 128-row
                        segments; Hopper; only when named)
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

import jax
import jax.numpy as jnp

from moe_jax import grouped_gemm, quant
from moe_jax.cli import gpu_clocks, layer_report, tokamax_peer
from moe_jax.cli.timing import rel_error, time_jax
from moe_jax.cli.tokamax_peer import sorted_moe
from moe_jax.contiguous_experts import ContiguousExperts
from moe_jax.experts import ExpertWeights
from moe_jax.fused_moe import fused_moe
from moe_jax.routing import fused_topk


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchShape:
    """A layer size: T tokens, E experts, top-k, hidden H, expert width I."""

    name: str
    num_tokens: int
    num_experts: int
    topk: int
    hidden: int
    intermediate: int

    @property
    def flops(self) -> int:
        return 6 * self.num_tokens * self.topk * self.hidden * self.intermediate

    def __str__(self) -> str:
        return (
            f"{self.name}: T={self.num_tokens} E={self.num_experts} k={self.topk} "
            f"H={self.hidden} I={self.intermediate}"
        )


SHAPES = {
    "A": BenchShape(
        name="A", num_tokens=4096, num_experts=32, topk=8, hidden=7168, intermediate=2048
    ),
    "B": BenchShape(
        name="B", num_tokens=8192, num_experts=128, topk=8, hidden=2048, intermediate=768
    ),
    "small": BenchShape(
        name="small", num_tokens=256, num_experts=8, topk=2, hidden=256, intermediate=128
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Variant:
    """How one moe_jax FP8 variant builds its experts.

    Attributes:
      fused_act_quant: "auto" (`fused_moe(experts="auto")`), None (`ContiguousExperts` never
        fused) or a fused GEMM1 backend (`ContiguousExperts(fused_act_quant=...)` with 128-row
        segments).
      is_graph: DeepGEMM calls XLA may capture into a CUDA graph (`_graph_experts`).
    """

    fused_act_quant: str | None = "auto"
    is_graph: bool = False


FP8_VARIANTS = {
    "moe_jax_fp8": Fp8Variant(),
    "moe_jax_fp8_unfused": Fp8Variant(fused_act_quant=None),
    "moe_jax_fp8_graph": Fp8Variant(fused_act_quant=None, is_graph=True),
    "moe_jax_fp8_fused_act": Fp8Variant(fused_act_quant="mosaic_fp8"),
    "moe_jax_fp8_fused_act_graph": Fp8Variant(fused_act_quant="mosaic_fp8", is_graph=True),
    "moe_jax_fp8_gathered": Fp8Variant(fused_act_quant="mosaic_fp8_gathered"),
}
VARIANTS = (
    "jax_ragged_dot_bf16",
    "jax_mosaic_bf16",
    "torch_deep_gemm_fp8",
    *tokamax_peer.PEERS,
    "moe_jax_bf16",
    *FP8_VARIANTS,
)
# run only when named in --variants
OPT_IN_VARIANTS = tuple(name for name in FP8_VARIANTS if name != "moe_jax_fp8")
BASELINES = ("jax_ragged_dot_bf16", "jax_mosaic_bf16", "torch_deep_gemm_fp8", *tokamax_peer.PEERS)


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer's inputs: bf16 and FP8 forms of the same expert weights, routed tokens.

    Attributes:
      x: bf16[T, H]; topk_weights float32[T, k]; topk_ids int32[T, k].
      w1, w2: bf16[E, 2I, H], bf16[E, H, I].
      w1q, w1s, w2q, w2s: the same weights as float8_e4m3fn with float32 128x128 block scales.
    """

    x: jax.Array
    topk_weights: jax.Array
    topk_ids: jax.Array
    w1: jax.Array
    w2: jax.Array
    w1q: jax.Array
    w1s: jax.Array
    w2q: jax.Array
    w2s: jax.Array


def make_layer(shape: BenchShape, seed: int = 0) -> Layer:
    """Random tokens, softmax top-k routing and scaled random weights of `shape`."""
    s = shape
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(keys[0], (s.num_tokens, s.hidden), jnp.bfloat16)
    logits = jax.random.normal(keys[1], (s.num_tokens, s.num_experts), jnp.float32)
    topk_weights, topk_ids = fused_topk(logits, s.topk)
    w1 = jax.random.normal(keys[2], (s.num_experts, 2 * s.intermediate, s.hidden), jnp.bfloat16)
    w2 = jax.random.normal(keys[3], (s.num_experts, s.hidden, s.intermediate), jnp.bfloat16)
    w1 = (w1 * s.hidden**-0.5).astype(jnp.bfloat16)
    w2 = (w2 * s.intermediate**-0.5).astype(jnp.bfloat16)
    w1q, w1s = jax.jit(quant.per_block_quant_fp8)(w1)
    w2q, w2s = jax.jit(quant.per_block_quant_fp8)(w2)
    return Layer(x, topk_weights, topk_ids, w1, w2, w1q, w1s, w2q, w2s)


def reference(layer: Layer, *, fp8: bool) -> jax.Array:
    """float32 forward on the same weights (dequantized FP8 for fp8), via `experts="xla"`."""
    if fp8:
        w1 = quant.dequant_per_block(layer.w1q, layer.w1s)
        w2 = quant.dequant_per_block(layer.w2q, layer.w2s)
    else:
        w1, w2 = layer.w1.astype(jnp.float32), layer.w2.astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        return jax.jit(lambda *a: fused_moe(*a, experts="xla"))(
            layer.x.astype(jnp.float32), w1, w2, layer.topk_weights, layer.topk_ids
        )


def _lax_ragged(rows, w, sizes):
    return jax.lax.ragged_dot(
        rows, jnp.swapaxes(w, 1, 2), sizes, preferred_element_type=jnp.float32
    ).astype(rows.dtype)


def _mosaic_ragged(rows, w, sizes):
    return grouped_gemm.GEMMS.get("mosaic").ragged_dot(rows, w, sizes, rows.dtype)


def jax_variant(name: str, layer: Layer) -> tuple[Callable, tuple] | str:
    """(jitted fn, args) for a JAX variant (one of `VARIANTS` but torch's), or why it cannot run
    here."""
    bf16_args = (layer.x, layer.w1, layer.w2, layer.topk_weights, layer.topk_ids)
    if name == "jax_ragged_dot_bf16":
        return jax.jit(functools.partial(sorted_moe, ragged_dot=_lax_ragged)), bf16_args
    if name == "jax_mosaic_bf16":
        if jax.default_backend() != "gpu":
            return "needs an NVIDIA GPU"
        return jax.jit(functools.partial(sorted_moe, ragged_dot=_mosaic_ragged)), bf16_args
    if name in tokamax_peer.PEERS:
        if (why := tokamax_peer.unavailable_reason(name)) is not None:
            return why
        w1, w2 = jax.jit(tokamax_peer.to_kn)(layer.w1, layer.w2)  # once, not timed
        return jax.jit(tokamax_peer.peer_layer(name)), (layer.x, w1, w2, *bf16_args[3:])
    if name == "moe_jax_bf16":
        return jax.jit(lambda *a: fused_moe(*a, experts="auto")), bf16_args
    if name in FP8_VARIANTS:
        variant = FP8_VARIANTS[name]
        fused = variant.fused_act_quant
        experts = "auto"
        if fused not in (None, "auto") and jax.default_backend() != "gpu":
            return "needs an NVIDIA GPU"
        if variant.is_graph:
            experts = _graph_experts(layer, fused_act_quant=fused)
            if isinstance(experts, str):
                return experts
        elif fused is None:
            experts = ContiguousExperts(fused_act_quant=None)
        elif fused != "auto":
            experts = ContiguousExperts(alignment=128, fused_act_quant=fused)
        fp8_args = (
            layer.x,
            layer.w1q,
            layer.w2q,
            layer.topk_weights,
            layer.topk_ids,
            layer.w1s,
            layer.w2s,
        )
        return jax.jit(
            lambda x, w1, w2, tw, ti, s1, s2: fused_moe(
                x, w1, w2, tw, ti, w1_scale=s1, w2_scale=s2, experts=experts
            )
        ), fp8_args
    raise ValueError(f"unknown variant {name!r}; choose from {list(VARIANTS)}")


def _graph_experts(
    layer: Layer, *, fused_act_quant: str | grouped_gemm.GroupedGemm | None = None
) -> ContiguousExperts | str:
    """`ContiguousExperts` whose DeepGEMM calls are CUDA-graph capturable, or why not here;
    with `fused_act_quant`, GEMM1 + act * up + quantize run by that backend on 128-row segments.

    DeepGEMM must have JIT-compiled every shape before XLA first captures a call, so this runs
    the layer once through the plain DeepGEMM backend first.
    """
    if jax.default_backend() != "gpu":
        return "needs an NVIDIA GPU"
    from moe_jax.interop import deep_gemm

    backend = deep_gemm.DeepGemm(deep_gemm.DeepGemmConfig(command_buffer_compatible=True))
    if fused_act_quant is None:
        experts = ContiguousExperts(gemm=backend)
    else:
        experts = ContiguousExperts(gemm=backend, alignment=128, fused_act_quant=fused_act_quant)
    weights = ExpertWeights(w1=layer.w1q, w2=layer.w2q, w1_scale=layer.w1s, w2_scale=layer.w2s)
    num_tokens, topk = layer.topk_ids.shape
    try:
        experts.plan_for(weights, num_tokens=num_tokens, topk=topk, x_dtype=quant.FP8_DTYPE)
    except NotImplementedError as refusal:  # NoImplementationError: every reason in its text
        return str(refusal)
    warm_up = jax.jit(
        lambda x, w, tw, ti: fused_moe(
            x, w.w1, w.w2, tw, ti, w1_scale=w.w1_scale, w2_scale=w.w2_scale, experts="deep_gemm"
        )
    )
    jax.block_until_ready(warm_up(layer.x, weights, layer.topk_weights, layer.topk_ids))
    return experts


def run_variant(name: str, layer: Layer, refs: dict, *, iters: int) -> dict:
    """One table row: times, error against the float32 reference, or why it was skipped; with
    what the GPU's clock did while the variant was timed ("clocks", where nvidia-smi runs).
    A JAX variant's row also holds its first call's wall time in seconds ("first_call_s"):
    tracing and XLA's compilation included, unless this process compiled the same program
    before, and DeepGEMM's JIT compilation of any shape its cache (`DG_JIT_CACHE_DIR`) lacks
    (the "_graph" variants run DeepGEMM once when they are built, so theirs comes before)."""
    clocks = gpu_clocks.ClockMonitor()
    if name == "torch_deep_gemm_fp8":
        from moe_jax.cli import torch_baseline

        with clocks:  # builds and checks the torch pipeline too, then times it
            result = torch_baseline.run(layer, iters=iters)
        if isinstance(result, str):
            return dict(skipped=result)
        out, ms, latency_ms = result
        first_call_s = None  # the torch pipeline's first call ran inside its own check
    else:
        built = jax_variant(name, layer)
        if isinstance(built, str):
            return dict(skipped=built)
        fn, args = built
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        first_call_s = time.perf_counter() - start
        with clocks:
            ms, latency_ms = time_jax(fn, args, iters=iters)
    ref = refs["fp8" if "_fp8" in name else "bf16"]
    row = dict(ms=ms, latency_ms=latency_ms, rel_err=rel_error(out, ref))
    if first_call_s is not None:
        row["first_call_s"] = first_call_s
    if clocks.summary is not None:
        row["clocks"] = dataclasses.asdict(clocks.summary)
    return row


def run(
    shape_names: Sequence[str],
    variants: Sequence[str],
    *,
    iters: int,
    progress: TextIO | None = None,
) -> list[dict]:
    """Table rows for every shape and variant; progress lines go to `progress` (default: the
    current sys.stderr, looked up per call so that captured streams see it)."""
    progress = sys.stderr if progress is None else progress
    rows = []
    steps = len(shape_names) * len(variants)
    step = 0
    for shape_name in shape_names:
        shape = SHAPES[shape_name]
        print(f"[{shape}] building inputs and float32 references", file=progress, flush=True)
        layer = make_layer(shape)
        refs = {"bf16": reference(layer, fp8=False), "fp8": reference(layer, fp8=True)}
        for name in variants:
            step += 1
            print(f"[{step}/{steps}] {shape.name} {name}", file=progress, flush=True)
            try:
                row = run_variant(name, layer, refs, iters=iters)
            except Exception as error:  # a broken variant is reported, the others still run
                row = dict(skipped=f"failed: {type(error).__name__}: {error}"[:200])
            row.update(shape=shape.name, variant=name)
            if "ms" in row:
                row["tflops"] = shape.flops / row["ms"] / 1e9
            rows.append(row)
    _add_ratios(rows)
    return rows


def _add_ratios(rows: list[dict]) -> None:
    """vs_best_baseline = best baseline time of the shape / this time."""
    for shape in {r["shape"] for r in rows}:
        base = [
            r["ms"] for r in rows if r["shape"] == shape and r["variant"] in BASELINES and "ms" in r
        ]
        for r in rows:
            if r["shape"] == shape and "ms" in r and base:
                r["vs_best_baseline"] = min(base) / r["ms"]


def _check_names(given: Sequence[str], known: Sequence[str], what: str) -> None:
    for name in given:
        if name not in known:
            raise SystemExit(f"unknown {what} {name!r}; choose from {list(known)}")


def run_layer_bench(
    *,
    shapes: Sequence[str] | None = None,
    variants: Sequence[str] | None = None,
    iters: int = 20,
    json_path: str | None = None,
    plot_path: str | None = None,
    progress: TextIO | None = None,
) -> int:
    """The `bench` command: runs, prints the tables, writes JSON/PNG; returns the exit status.

    Args:
      shapes: names from `SHAPES`; None: A and B on a GPU, "small" elsewhere.
      variants: names from `VARIANTS`; None: all but `OPT_IN_VARIANTS`.
      iters: latency samples per variant (streamed samples: max(3, iters // 2)).
      json_path: write {"environment", "rows"} there.
      plot_path: write a PNG bar chart there.
    """
    progress = sys.stderr if progress is None else progress
    shape_names = list(shapes or (["A", "B"] if jax.default_backend() == "gpu" else ["small"]))
    variants = list(variants or [v for v in VARIANTS if v not in OPT_IN_VARIANTS])
    _check_names(shape_names, sorted(SHAPES), "shape")
    _check_names(variants, VARIANTS, "variant")
    rows = run(shape_names, variants, iters=iters, progress=progress)
    env = layer_report.environment()
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(layer_report.format_table(rows))
    return layer_report.write_outputs(
        dict(environment=env, rows=rows),
        json_path=json_path,
        plot_path=plot_path,
        draw=lambda path: layer_report.plot(rows, path, shapes=SHAPES, baselines=BASELINES),
    )
