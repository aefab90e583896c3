"""Writes the exploration notebooks (ruff-formatted): `python notebooks/_build.py`.

The notebooks are generated so that their code stays reviewable as Python; edit here, rerun,
commit the .ipynb files. tests/test_notebooks.py executes them. Outputs are cleared, except in
the notebooks of `EXECUTED`, which this script runs (with the kernel of this interpreter) and
writes with their outputs, so a reader of the repository sees their plots.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = pathlib.Path(__file__).parent


def md(text: str):
    return new_markdown_cell(text.strip())


def code(text: str):
    return new_code_cell(text.strip())


# Every notebook's first cell: how to get what it imports (moe_jax is not on PyPI).
INSTALL = """
**Setup.** From a clone of the moe_jax repository: `pip install -e '.[notebooks]'` (on a machine
without a GPU, `pip install torch --index-url https://download.pytorch.org/whl/cpu` first, if you
want the torch backends too). Then open this notebook from the clone's `notebooks/` folder.
"""


TOUR = [
    md("""
# A tour of `moe_jax.flax_layer.MoE`

Build a small DeepSeek-style MoE layer, route tokens, look at the expert load, run every experts
backend that works on this machine, and check them against `moe_jax.moe_reference` (a float32
loop over all experts). Small shapes: this runs on a laptop CPU in seconds.
"""),
    code("""
import functools

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

import moe_jax
from moe_jax.cli.timing import time_calls
from moe_jax.flax_layer import MoE, RouterConfig

print(jax.__version__, jax.default_backend())
"""),
    md("""
## Build a layer

Expert weights use vLLM's layout: `w1` [E, 2I, H] (gate rows, then up rows), `w2` [E, H, I].
The router is DeepSeek-V3's: sigmoid scores, 8 groups of experts of which 4 survive per token,
a correction bias that steers the choice, and a routed scaling factor.
"""),
    code("""
H, I, E, K = 256, 128, 32, 4  # noqa: E741 (I is the expert width, as in DESIGN.md)
router = RouterConfig(scoring_func="sigmoid", num_expert_group=8, topk_group=4,
                      use_correction_bias=True, routed_scaling_factor=2.5)
layer = MoE(H, I, num_experts=E, topk=K, router=router, rngs=nnx.Rngs(0))
for name, p in nnx.state(layer, nnx.Param).items():
    print(f"{name:<24} {str(p.shape):<16} {p.dtype}")
"""),
    md("## Route tokens and inspect the expert load"),
    code("""
T = 512
x = jax.random.normal(jax.random.PRNGKey(1), (T, H))
topk_weights, topk_ids = layer.route(x)
load = np.bincount(np.asarray(topk_ids).ravel(), minlength=E)
print("tokens per expert:", load.tolist())
print(f"max/mean load: {load.max() / load.mean():.2f}  (1.00 is perfectly balanced)")
assert load.sum() == T * K

fig, ax = plt.subplots(figsize=(8, 3))
ax.bar(np.arange(E), load, color=[f"C{g}" for g in np.arange(E) // (E // 8)])
ax.axhline(T * K / E, color="k", ls="--", lw=1, label="balanced")
ax.set(xlabel="expert (colour = group)", ylabel="tokens routed", title=f"Expert load, T={T}, k={K}")
ax.legend()
plt.show()
"""),
    md("""
## Every experts backend that runs here

`moe_jax.experts_names()` lists the backends `fused_moe(experts=...)` accepts. Each one either
runs or says why not (DeepGEMM and Mosaic need an NVIDIA GPU). Every one that runs must agree with
the float32 reference on the same routing. Times come from `moe_jax.cli.timing`, the timing loop
of the project's benchmarks (median of back-to-back calls).
"""),
    code("""
xb = x[:128]  # the masked layout is [E, T*k, H] per call: keep T small on a CPU
ref = moe_jax.moe_reference(xb, layer.w1[...], layer.w2[...], *layer.route(xb))

def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))

rows = []
for name in moe_jax.experts_names():
    candidate = MoE(H, I, num_experts=E, topk=K, router=router, experts=name, rngs=nnx.Rngs(0))
    forward = nnx.jit(lambda m, x: m(x))
    try:
        out = jax.block_until_ready(forward(candidate, xb))
    except (NotImplementedError, ValueError, ImportError, RuntimeError) as why:
        reason = str(why).splitlines()[0]
        rows.append((name, "refused", "..." + reason[-67:] if len(reason) > 70 else reason, None))
        continue
    timing = time_calls(functools.partial(forward, candidate, xb), wait=jax.block_until_ready,
                        samples=2, burst=1)
    ms = timing.streamed_ms
    rows.append((name, "ran", f"{ms:.1f} ms", rel_err(out, ref)))

print(f"{'experts':<18} {'status':<8} {'time / reason':<72} rel. err")
for name, status, info, err in rows:
    print(f"{name:<18} {status:<8} {info:<72} {'' if err is None else f'{err:.1e}'}")
ran = [r for r in rows if r[1] == "ran"]
assert {"xla", "xla_masked"} <= {r[0] for r in ran}
assert all(r[3] < 1e-5 for r in ran), rows
"""),
    md("""
## FP8 block-quantized weights

`MoE.quantize()` stores the expert weights as float8_e4m3fn with one float32 scale per 128x128
tile (vLLM's and DeepGEMM's recipe); activations are quantized per token per 128 columns inside
the forward. The error against the float layer is the price of FP8: a few percent.
"""),
    code("""
float_out = layer(x)
fp8_layer = MoE(H, I, num_experts=E, topk=K, router=router, rngs=nnx.Rngs(0)).quantize()
print({k: (v.shape, str(v.dtype)) for k, v in nnx.state(fp8_layer, nnx.Param).items()
       if k.startswith("w")})
fp8_out = nnx.jit(lambda m, x: m(x))(fp8_layer, x)
fp8_ref = moe_jax.moe_reference(x, fp8_layer.w1[...], fp8_layer.w2[...], topk_weights, topk_ids,
                                w1_scale=fp8_layer.w1_scale[...], w2_scale=fp8_layer.w2_scale[...])
print(f"FP8 layer vs float layer:            {rel_err(fp8_out, float_out):.3f}")
print(f"FP8 layer vs reference on FP8 weights: {rel_err(fp8_out, fp8_ref):.3f} "
      "(activation quantization only)")
assert rel_err(fp8_out, float_out) < 0.1
"""),
]

ROUTING = [
    md("""
# Routing: softmax top-k, grouped top-k, and the correction bias

Tokens whose router logits favour one group of experts overload it. We compare plain softmax
top-k (Mixtral, Qwen3) with DeepSeek's grouped top-k, then use DeepSeek-V3's correction bias, which
changes which experts are chosen but not their weights, to pull load off the hot group.
"""),
    code("""
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

from moe_jax.flax_layer import MoE, RouterConfig
from moe_jax.routing import fused_topk, grouped_topk

H, I, E, K, G = 64, 32, 64, 6, 8  # noqa: E741 (8 groups of 8 experts)
T = 4096
per_group = E // G
key_x, key_r = jax.random.split(jax.random.PRNGKey(0))
x = jax.random.normal(key_x, (T, H))

def make(router):
    layer = MoE(H, I, num_experts=E, topk=K, router=router, rngs=nnx.Rngs(0))
    # A skewed router: experts of group 0 get a boost, as after a data shift.
    kernel = jax.random.normal(key_r, (H, E)) / np.sqrt(H)   # logits ~ N(0, 1)
    layer.router_kernel.set_value(kernel)
    return layer

HOT = np.arange(per_group)                 # the overloaded group's experts
boost = jnp.zeros(E).at[HOT].set(0.5)

@nnx.jit
def load_of(layer, x):
    logits = layer.router_logits(x) + boost[None, :]       # skew the logits
    ids = layer_route(layer, logits)
    return jnp.bincount(ids.ravel(), length=E)

def layer_route(layer, logits):
    # The layer's own routing rule on given logits (route() computes the logits from x itself).
    r = layer.router
    if not r.is_grouped:
        return fused_topk(logits, K, r.renormalize, r.scoring_func)[1]
    bias = layer.e_score_correction_bias
    return grouped_topk(logits, K, r.renormalize, G, r.topk_group,
                        scoring_func=r.scoring_func,
                        e_score_correction_bias=None if bias is None else bias[...])[1]
"""),
    md("## Softmax top-k vs grouped top-k on the same skewed logits"),
    code("""
softmax = make(RouterConfig())
grouped = make(RouterConfig(scoring_func="sigmoid", num_expert_group=G, topk_group=2))
loads = {"softmax top-k": np.asarray(load_of(softmax, x)),
         "grouped top-k (2 of 8 groups)": np.asarray(load_of(grouped, x))}

def imbalance(load):
    return load.max() / load.mean()

fig, axes = plt.subplots(1, 2, figsize=(11, 3), sharey=True)
for ax, (name, load) in zip(axes, loads.items(), strict=True):
    ax.bar(np.arange(E), load, color=[f"C{g}" for g in np.arange(E) // per_group])
    ax.axhline(T * K / E, color="k", ls="--", lw=1)
    ax.set(title=f"{name}: max/mean {imbalance(load):.2f}", xlabel="expert (colour = group)")
axes[0].set_ylabel("tokens routed")
plt.show()
for name, load in loads.items():
    hot_share = load[HOT].sum() / load.sum()
    print(f"{name:<32} hot-group share {hot_share:.2f} (balanced: {1 / G:.3f}), "
          f"max/mean {imbalance(load):.2f}")
    assert load.sum() == T * K
    assert hot_share > 1.5 / G  # the boost overloads group 0 under both routers
"""),
    md("""
Grouped top-k does not balance anything by itself: it caps how many groups (in DeepSeek, nodes)
a token reaches, which bounds dispatch traffic. On skewed logits the hot group stays hot.
"""),
    md("""
## Sweeping the correction bias of the hot group

DeepSeek-V3 adds `e_score_correction_bias` to the sigmoid scores when it chooses groups and
experts; the routing weights still come from the unbiased scores. A negative bias on the hot
group's experts moves tokens elsewhere.
"""),
    code("""
biased = make(RouterConfig(scoring_func="sigmoid", num_expert_group=G, topk_group=2,
                           use_correction_bias=True))
sweep = np.linspace(0.0, -0.3, 16)
hot_share, worst = [], []
for b in sweep:
    biased.e_score_correction_bias.set_value(jnp.zeros(E).at[HOT].set(b))
    load = np.asarray(load_of(biased, x))
    hot_share.append(load[HOT].sum() / load.sum())
    worst.append(imbalance(load))

fig, ax = plt.subplots(figsize=(6, 3.2))
ax.plot(sweep, hot_share, "o-", label="hot group's share of tokens")
ax.axhline(1 / G, color="k", ls="--", lw=1, label="balanced share (1/8)")
ax.set(xlabel="correction bias on the hot group's experts", ylabel="share of routed tokens")
ax.invert_xaxis()
ax2 = ax.twinx()
ax2.plot(sweep, worst, "s-", color="C3", label="max/mean expert load")
ax2.set_ylabel("max/mean expert load", color="C3")
fig.legend(loc="upper right", bbox_to_anchor=(0.87, 0.88), fontsize=8)
plt.show()
assert hot_share[0] > 1.5 / G and hot_share[-1] < hot_share[0] / 2
assert np.all(np.diff(hot_share) <= 1e-9)  # monotone in the bias
"""),
    md("""
Past the balanced share the bias overshoots: the group is starved and the imbalance moves
elsewhere. A fixed bias needs tuning per data distribution; the update rule below finds it.
"""),
    md("""
## The aux-loss-free balancing rule

DeepSeek-V3 updates the bias after each step: `b_e -= gamma * sign(load_e - mean load)`. A
few steps flatten the load without touching the routing weights (and without an auxiliary loss);
then the fixed step `gamma` makes it hover around a floor set by how unevenly the router spreads
tokens within groups.
"""),
    code("""
gamma, steps = 0.02, 60
biased.e_score_correction_bias.set_value(jnp.zeros(E))
history = []
for _ in range(steps):
    load = np.asarray(load_of(biased, x))
    history.append(imbalance(load))
    b = biased.e_score_correction_bias[...]
    biased.e_score_correction_bias.set_value(b - gamma * jnp.sign(load - load.mean()))

fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(history)
ax.set(xlabel="update step", ylabel="max/mean expert load", title=f"bias update, gamma={gamma}")
plt.show()
print(f"max/mean load: {history[0]:.2f} -> {history[-1]:.2f}")
assert history[-1] < 0.6 * history[0]
"""),
]

PERF = [
    md("""
# The roofline of an MoE layer on an H200

A forward of T tokens, k experts each, hidden size H, expert width I:

* FLOPs: GEMM1 `2*T*k*H*2I` + GEMM2 `2*T*k*I*H` = `6*T*k*H*I`.
* Bytes, two models:
  * **ideal**: every touched expert's weights once, tokens in, results out;
  * **modular pipeline** (what a permute -> GEMM1 -> act -> GEMM2 -> gather chain moves): the
    ideal bytes plus the permuted rows, the [T*k, 2I] and [T*k, I] intermediates and the
    [T*k, H] expert outputs, each written once and read once.

Ceilings (H200, measured on this project's host): ~4.3 TB/s copy bandwidth, ~790 TFLOP/s bf16
dense; FP8 dense ~1.3-1.6 PFLOP/s.
"""),
    code("""
import json
import os
import pathlib

import matplotlib.pyplot as plt
import numpy as np

BW = 4.3e12                      # bytes/s
PEAK = {"bf16": 790e12, "fp8": 1.45e15}
FP8_BAND = (1.3e15, 1.6e15)
SHAPES = {
    "A": dict(T=4096, E=32, k=8, H=7168, I=2048),
    "B": dict(T=8192, E=128, k=8, H=2048, I=768),
}

def experts_touched(T, E, k):
    # Expected distinct experts hit by T tokens routed uniformly without replacement.
    return E * (1 - (1 - k / E) ** T)

def cost(T, E, k, H, I, precision="bf16", model="ideal"):  # noqa: E741
    w_bytes = 1.0 if precision == "fp8" else 2.0
    a_bytes = 1.0 if precision == "fp8" else 2.0   # GEMM inputs; outputs stay bf16
    flops = 6.0 * T * k * H * I
    weights = experts_touched(T, E, k) * 3 * H * I * w_bytes
    scales = 0 if precision == "bf16" else experts_touched(T, E, k) * 3 * H * I / 128**2 * 4
    tokens = T * H * a_bytes + T * H * 2          # x in, bf16 out
    nbytes = weights + scales + tokens
    if model == "modular":
        rows = T * k
        nbytes += rows * H * a_bytes * 2          # permuted rows: write + read
        nbytes += rows * 2 * I * 2 * 2            # GEMM1 out (bf16): write + read
        nbytes += rows * I * a_bytes * 2          # act*up (requantized): write + read
        nbytes += rows * H * 2 * 2                # GEMM2 out (bf16): write + read
    return flops, nbytes

def bound_ms(flops, nbytes, precision):
    return max(flops / PEAK[precision], nbytes / BW) * 1e3
"""),
    md("## Shapes A and B"),
    code("""
print(f"{'shape':<6}{'prec':<6}{'model':<9}{'GFLOP':>9}{'MB':>9}{'FLOP/B':>9}"
      f"{'t_compute':>11}{'t_memory':>10}{'bound ms':>10}")
table = {}
for shape, s in SHAPES.items():
    for precision in ("bf16", "fp8"):
        for model in ("ideal", "modular"):
            f, b = cost(**s, precision=precision, model=model)
            t_c, t_m = f / PEAK[precision] * 1e3, b / BW * 1e3
            table[shape, precision, model] = bound_ms(f, b, precision)
            print(f"{shape:<6}{precision:<6}{model:<9}{f / 1e9:>9.0f}{b / 1e6:>9.0f}{f / b:>9.0f}"
                  f"{t_c:>11.2f}{t_m:>10.2f}{table[shape, precision, model]:>10.2f}")
ridge = {p: PEAK[p] / BW for p in PEAK}
print("ridge points (FLOP/byte):", {p: round(v) for p, v in ridge.items()})
# Both shapes are compute bound at these T: the roofline time is the GEMM time.
assert table["A", "bf16", "ideal"] > table["A", "fp8", "ideal"]
"""),
    md("""
For context, DESIGN.md's measured whole-layer times: shape A 7.45 ms and shape B 3.28 ms with
JAX + Mosaic ragged_dot (bf16), 9.44 / 5.97 ms with torch glue + DeepGEMM FP8; the moe_jax targets
are 3.0 / 1.0 ms with FP8 block weights. Compare them with the bounds above.
"""),
    md("## Sweeping T: from decode (weight-bandwidth bound) to prefill (compute bound)"),
    code("""
Ts = 2 ** np.arange(0, 17)
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
ai = np.logspace(0, 4, 200)
ax = axes[0]
for precision, style in (("bf16", "-"), ("fp8", "--")):
    ax.plot(ai, np.minimum(PEAK[precision], ai * BW) / 1e12, "k" + style, lw=1,
            label=f"ceiling {precision}")
ax.fill_between(ai, np.minimum(FP8_BAND[0], ai * BW) / 1e12,
                np.minimum(FP8_BAND[1], ai * BW) / 1e12, color="0.85", label="FP8 1.3-1.6 PF")
for i, (shape, s) in enumerate(SHAPES.items()):
    pts = [cost(T, s["E"], s["k"], s["H"], s["I"], "fp8", "modular") for T in Ts]
    x_ai = [f / b for f, b in pts]
    y = [f / (bound_ms(f, b, "fp8") * 1e-3) / 1e12 for f, b in pts]
    ax.plot(x_ai, y, "o", color=f"C{i}", ms=4, label=f"shape {shape}, fp8, T=1..65536")
ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)",
       ylabel="attainable TFLOP/s", title="Roofline (modular-pipeline bytes)")
ax.legend(fontsize=8)

ax = axes[1]
for i, (shape, s) in enumerate(SHAPES.items()):
    for precision, style in (("bf16", "-"), ("fp8", "--")):
        ms = [bound_ms(*cost(T, s["E"], s["k"], s["H"], s["I"], precision, "modular"), precision)
              for T in Ts]
        ax.plot(Ts, ms, style, color=f"C{i}", label=f"{shape} {precision}")
    ax.axvline(s["T"], color=f"C{i}", lw=0.8, ls=":")
ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="lower bound (ms)",
       title="Roofline time vs T")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
"""),
    md("""
## Measured points

Benchmarks write a JSON list of `{"shape", "variant", "ms", "tflops"}` records. The loader looks
at `$MOE_JAX_BENCH_JSON`, else `bench_results.json` next to this notebook, and skips records it
cannot use (with a note) instead of failing.
"""),
    code("""
def shape_name(value):
    # "A", "shape_A", "B: T=8192 ...", or a dict of T/E/k/H/I -> "A" or "B"; None if unknown.
    if isinstance(value, dict):
        return next((n for n, s in SHAPES.items() if all(value.get(d) == v for d, v in s.items())),
                    None)
    text = str(value).strip().upper().removeprefix("SHAPE").strip(" _-:")
    head = text.split(":")[0].split()[0] if text else ""
    return head if head in SHAPES else None

def load_bench(path=None):
    path = pathlib.Path(path or os.environ.get("MOE_JAX_BENCH_JSON") or "bench_results.json")
    if not path.is_file():
        print(f"no benchmark results at {path}: run the benchmarks and save their JSON there "
              "(or set MOE_JAX_BENCH_JSON) to see measured points")
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as why:
        print(f"cannot read {path}: {why}")
        return []
    if isinstance(data, dict):           # `python -m moe_jax bench --json` writes {"rows": [...]}
        data = data.get("rows", data.get("results", []))
    records, skipped = [], 0
    for r in data if isinstance(data, list) else []:
        try:
            shape, ms = shape_name(r["shape"]), float(r["ms"])
            if shape is None or not ms > 0:
                raise ValueError(r)
            tflops = r.get("tflops")
            tflops = float(tflops) if tflops else cost(**SHAPES[shape])[0] / (ms * 1e-3) / 1e12
            records.append(dict(shape=shape, variant=str(r.get("variant", "?")), ms=ms,
                                tflops=tflops))
        except (KeyError, TypeError, ValueError, AttributeError):
            skipped += 1
    note = f", {skipped} skipped" if skipped else ""
    print(f"{len(records)} measured points from {path}{note}")
    return records

measured = load_bench()
for r in measured:
    bound = min(table[r["shape"], p, "ideal"] for p in ("bf16", "fp8"))
    print(f"shape {r['shape']} {r['variant']:<28} {r['ms']:8.2f} ms {r['tflops']:8.1f} TFLOP/s"
          f"   {bound / r['ms']:6.1%} of the FP8 roofline")
if measured:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, shape in enumerate(SHAPES):
        pts = [r for r in measured if r["shape"] == shape]
        ax.barh([f"{shape}: {r['variant']}" for r in pts], [r["ms"] for r in pts], color=f"C{i}")
        ax.axvline(table[shape, "fp8", "ideal"], color=f"C{i}", ls="--", lw=1)
    ax.set(xscale="log", xlabel="ms per layer forward (dashed: FP8 roofline bound)")
    plt.tight_layout()
    plt.show()
"""),
    md("""
## Decode: measured against the weight-read limit

`python -m moe_jax bench --decode --json decode_results.json` times DeepSeek-V3's experts on one
GPU (E=256, H=7168, I=2048, k=8, FP8) for each T and experts backend, after checking each against
float32. A decode step's floor is reading the active experts' weights once ("limit", at 4.8 TB/s).
`decode_results.json` next to this notebook is the H200 run of 2026-12-02 on code e33f5c2
(BENCHMARKS.md, "Decode-size layers": the Pallas grouped GEMM on 16-, 32- or 64-row segments by
pairs per expert): "auto" with the Pallas grouped GEMM and DeepGEMM beside it, T=1 to 2048.
Since 2026-12-03 "auto" takes the Mosaic GPU kernel `mosaic_fp8` from 17 to 192 pairs per expert
(T=2048: 3250 us in BENCHMARKS.md against 4758 in this file); a run with
`--variants auto pallas mosaic_fp8 deep_gemm` shows it here.
"""),
    code("""
def load_results(env_var, default, command):
    # The JSON at $env_var, else `default` next to this notebook; None (said) when absent.
    path = pathlib.Path(os.environ.get(env_var) or default)
    if path.is_file():
        return json.loads(path.read_text())
    print(f"no {default.removesuffix('.json').replace('_', ' ')} at {path}: run `{command}`")
    return None

decode = load_results("MOE_JAX_DECODE_JSON", "decode_results.json",
                      "python -m moe_jax bench --decode --json ...")
if decode is not None:
    env = decode["environment"]
    print(f"{env.get('device')}, jax {env.get('jax')}, {env.get('date')}")
    rows = decode["rows"]
    names = [n for n in ("auto", "pallas", "mosaic_fp8", "deep_gemm", "deep_gemm_masked")
             if n in rows[0]["variants"]]
    print(f"{'T':>5} {'experts':>8} {'limit us':>9}" + "".join(f"{n:>18}" for n in names))
    for r in rows:
        cells = []
        for n in names:
            v = r["variants"][n]
            cells.append(f"{v['us']:>8.0f} ({v['us'] / r['limit_us']:.2f}x)" if "us" in v
                         else f"{'refused':>18}")
        print(f"{r['tokens']:>5} {r['active_experts']:>8} {r['limit_us']:>9.0f}"
              + "".join(f"{c:>18}" for c in cells))
    fig, ax = plt.subplots(figsize=(7, 4))
    tokens = [r["tokens"] for r in rows]
    ax.plot(tokens, [r["limit_us"] for r in rows], "k--", label="weight-read limit")
    ax.plot(tokens, [1.25 * r["limit_us"] for r in rows], "k:", lw=1, label="1.25x limit (goal)")
    for n in names:
        pts = [(r["tokens"], r["variants"][n]["us"]) for r in rows if "us" in r["variants"][n]]
        ax.plot(*zip(*pts, strict=True), "o-", label=n)
    ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="us per layer (streamed)",
           title="decode MoE layer, DeepSeek-V3 experts, one H200")
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
"""),
    md("""
## Where a forward's device time goes

`python -m benchmarks.kernel_gaps --shape A --json ...` (or `--decode-tokens T`), run from the
repository root, traces the bench's own timing loop with `jax.profiler` and records each kernel's
device time per forward.
`profile_results.json` next to this notebook holds four such profiles from one H200 call of
2026-12-02 (BENCHMARKS.md, "Prefill" and "Decode"). The kernels are summed by stage with the
tool's own `stage_of`; the bar's full length is the host clock per call, so what is left of it
past the kernels is the host's share (launches, the lead-in of each burst).
"""),
    code("""
import sys

sys.path.append(str(pathlib.Path.cwd().parent))  # benchmarks/ is at the repository root
from benchmarks.kernel_gaps import STAGES, OTHER_STAGE, stage_of  # noqa: E402

profiles = load_results("MOE_JAX_PROFILE_JSON", "profile_results.json",
                        "python -m benchmarks.kernel_gaps --json ...")
if profiles is not None:
    env = profiles["environment"]
    print(f"{env['device']}, jax {env['jax']}, DeepGEMM {env['deep_gemm']}, {env['date']}")
    stage_names = [name for name, _ in STAGES] + [OTHER_STAGE]
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for row, p in enumerate(profiles["profiles"]):
        by_stage = dict.fromkeys(stage_names, 0.0)
        for kernel in p["kernels"]:
            by_stage[stage_of(kernel["name"])] += kernel["ns"] / 1e3
        device = sum(by_stage.values())
        assert device <= p["host_us"] * 1.01, (p["label"], device, p["host_us"])
        shares = "  ".join(f"{n} {100 * us / device:.0f}%" for n, us in by_stage.items())
        print(f"{p['label']:>13}: host {p['host_us']:7.1f} us, kernels {device:7.1f} us  {shares}")
        left = 0.0
        for i, (name, us) in enumerate(by_stage.items()):
            ax.barh(row, us / p["host_us"], left=left, color=f"C{i}",
                    label=name if row == 0 else None)
            left += us / p["host_us"]
        ax.barh(row, max(0.0, 1 - left), left=left, color="lightgrey",
                label="host" if row == 0 else None)
    labels = [f"{p['label']} ({p['host_us']:.0f} us)" for p in profiles["profiles"]]
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set(xlabel="share of the host clock per call", xlim=(0, 1))
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    plt.tight_layout()
    plt.show()
"""),
]


TRAINING = [
    md("""
# Training an MoE block

A pre-norm residual block, `x + MoE(RMSNorm(x))`, learns to imitate a teacher block on tokens
drawn from clusters: the teacher sends each cluster to its own expert, so the student's router
has to learn where tokens go. optax's Adam through `nnx.Optimizer`; gradients flow through
`fused_moe` into the expert weights and, via the routing weights, into the router. Then
DeepSeek-V3's correction bias balances the expert load during training. Small shapes: well under
a minute on a laptop CPU.
"""),
    code("""
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx

from moe_jax.contiguous_experts import ContiguousExperts
from moe_jax.experts import ExpertWeights
from moe_jax.flax_layer import MoE, RouterConfig
from moe_jax.grouped_gemm_backward import WGRADS, wgrad_problem

print(jax.__version__, jax.default_backend())
"""),
    md("""
## Data and teacher

Tokens are noisy copies of 8 cluster centres, the clusters Zipf-distributed (the first is 8x as
common as the last, as real token distributions are skewed). The teacher's router kernel points at
the centres, so cluster c goes to expert c first; its experts are random MLPs, scaled up so that
the target is far from the identity.
"""),
    code("""
H, I, E, K = 32, 32, 8, 2  # noqa: E741 (I is the expert width, as in DESIGN.md)
B, S = 8, 64               # 512 tokens per step
STEPS = 300
centers = jax.random.normal(jax.random.PRNGKey(0), (E, H))
cluster_logp = -jnp.log(jnp.arange(1.0, E + 1))  # Zipf: p(c) ~ 1 / (c + 1)

@jax.jit
def batch(step):
    key_c, key_n = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(1), step))
    cluster = jax.random.categorical(key_c, cluster_logp, shape=(B, S))
    return centers[cluster] + 0.5 * jax.random.normal(key_n, (B, S, H))

class Block(nnx.Module):  # pre-norm residual MoE block
    def __init__(self, router: RouterConfig, *, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(H, rngs=rngs)
        self.moe = MoE(H, I, num_experts=E, topk=K, router=router, rngs=rngs)

    def __call__(self, x):
        return x + self.moe(self.norm(x))

SIGMOID = RouterConfig(scoring_func="sigmoid")
teacher = Block(SIGMOID, rngs=nnx.Rngs(100))
unit_centers = centers / jnp.linalg.norm(centers, axis=1, keepdims=True)
teacher.moe.router_kernel.set_value(4.0 * unit_centers.T)  # [H, E]: cluster c -> expert c
teacher.moe.w1.set_value(2.0 * teacher.moe.w1[...])
teacher.moe.w2.set_value(2.0 * teacher.moe.w2[...])
"""),
    md("""
## The training step

The loss is the squared error divided by the mean square of the teacher's MoE output `y - x`:
about 1 at the start (the student's MoE output is small), 0 for a perfect copy. `LEARNED` chooses
what the optimizer updates. The correction bias is a `Param` but gets no gradient (it only
changes which experts win the top-k); DeepSeek-V3 nudges it after every step instead,
`b_e -= gamma * sign(load_e - mean load)`, inside the same jitted step.
"""),
    code("""
LEARNED = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("e_score_correction_bias")))
GAMMA = 1e-2

def make_train_step(learned):
    @nnx.jit
    def train_step(model, optimizer, x):
        y = teacher(x)
        energy = jnp.mean((y - x) ** 2)
        _, ids = model.moe.route(model.norm(x).reshape(-1, H))
        load = jnp.bincount(ids.ravel(), length=E)  # tokens per expert in this step

        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2) / energy

        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, learned))(model)
        optimizer.update(model, grads)
        bias = model.moe.e_score_correction_bias
        if bias is not None:  # DeepSeek-V3's aux-loss-free balancing
            bias.set_value(bias[...] - GAMMA * jnp.sign(load - load.mean()))
        return loss, load

    return train_step

def train(router, learned=LEARNED):
    model = Block(router, rngs=nnx.Rngs(0))  # the same initial student for every run
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=learned)
    # cached_partial binds the model and optimizer once, saving nnx.jit's per-call graph walk.
    train_step = nnx.cached_partial(make_train_step(learned), model, optimizer)
    losses, loads = [], []
    for step in range(STEPS):
        loss, load = train_step(batch(step))
        losses.append(float(loss))
        loads.append(np.asarray(load))
    return model, np.array(losses), np.array(loads)
"""),
    md("""
## Three students

The same initial student, trained three ways: sigmoid top-k routing; the same with the router
kernel frozen at its initialization (what the loss owes to the router learning); and with
DeepSeek-V3's correction bias (grouped routing with one group, so only the bias differs).
"""),
    code("""
BALANCED = RouterConfig(scoring_func="sigmoid", num_expert_group=1, topk_group=1,
                        use_correction_bias=True)
FROZEN_ROUTER = nnx.All(LEARNED, nnx.Not(nnx.PathContains("router_kernel")))
configs = {"sigmoid top-k": (SIGMOID, LEARNED), "frozen router": (SIGMOID, FROZEN_ROUTER),
           "+ correction bias": (BALANCED, LEARNED)}
runs = {}
start = time.perf_counter()
for name, (router, learned) in configs.items():
    runs[name] = train(router, learned)
print(f"{len(runs)} x {STEPS} steps in {time.perf_counter() - start:.1f} s")

def imbalance(load):
    return load.max() / load.mean()

final = {}
print(f"{'run':<20} {'loss: first -> last 20 steps':<30} max/mean load: first -> last 20")
for name, (_, losses, loads) in runs.items():
    final[name] = losses[-20:].mean(), imbalance(loads[-20:].mean(0))
    print(f"{name:<20} {losses[0]:.3f} -> {final[name][0]:.3f}{'':<16} "
          f"{imbalance(loads[0]):.2f} -> {final[name][1]:.2f}")

fig, ax = plt.subplots(figsize=(7, 3.5))
for name, (_, losses, _) in runs.items():
    ax.plot(losses, label=name)
ax.set(yscale="log", xlabel="step", ylabel="relative squared error", title="Training loss")
ax.legend()
plt.show()
assert all(losses[0] > 0.9 and final[name][0] < 0.3 * losses[0]
           for name, (_, losses, _) in runs.items())
assert final["sigmoid top-k"][0] < 0.85 * final["frozen router"][0]  # the router learned
"""),
    md("""
## Expert load over training

Tokens per expert at every step, relative to a perfectly balanced load (1.0). The plain router
follows the data: the hot clusters' experts stay hot. The correction bias flattens the load within
about twenty steps and keeps it flat while the router goes on learning; what is left is sampling
noise (128 tokens per expert per step) and the bias's fixed step. Its loss ends close to the plain
router's.
"""),
    code("""
fig, axes = plt.subplots(1, 2, figsize=(12, 3.2), sharey=True)
for ax, name in zip(axes, ["sigmoid top-k", "+ correction bias"], strict=True):
    loads = runs[name][2]
    image = ax.imshow((loads / loads.mean(1, keepdims=True)).T, aspect="auto", cmap="coolwarm",
                      vmin=0, vmax=2, interpolation="nearest")
    ax.set(title=f"{name}: max/mean {final[name][1]:.2f}, last 20 steps", xlabel="step")
axes[0].set_ylabel("expert")
fig.colorbar(image, ax=axes, label="load / balanced load")
plt.show()
assert final["+ correction bias"][1] < 1.25 < final["sigmoid top-k"][1]
"""),
    md("""
## Which backend ran

`MoE(experts="auto")` (the default) asks the GEMM registry for the fastest backend that takes
each GEMM: DeepGEMM, torch's grouped GEMM or Mosaic on an NVIDIA GPU, the XLA block loop
elsewhere. The backward runs each dgrad on its forward's backend where that backend takes the
transposed problem, and the weight gradients through the `WGRADS` registry. The same questions,
asked directly for this model's step:
"""),
    code("""
model = runs["sigmoid top-k"][0]
pair = ContiguousExperts().plan_for(ExpertWeights(w1=model.moe.w1[...], w2=model.moe.w2[...]),
                                        num_tokens=B * S, topk=K, x_dtype=jnp.float32)
rows = B * S * K
wgrad = WGRADS.select("auto", wgrad_problem(jax.ShapeDtypeStruct((rows, 2 * I), jnp.float32),
                                            jax.ShapeDtypeStruct((rows, H), jnp.float32),
                                            num_experts=E, alignment=pair.alignment))
print(f"experts={model.moe.experts!r} on {jax.default_backend()}: GEMM1 {pair.gemm1.name}, "
      f"GEMM2 {pair.gemm2.name} ({pair.alignment}-row segments), weight gradient {wgrad.name}")
if jax.default_backend() == "cpu":
    assert (pair.gemm1.name, pair.gemm2.name, wgrad.name) == ("xla", "xla", "xla")
"""),
    md("""
On a GPU, train in bf16 (`MoE(..., dtype=jnp.bfloat16)`) at sizes where the grouped GEMMs
matter; `python -m moe_jax bench --train` times such a step against a torchtitan-style torch
step, and `ContiguousExperts(recipe=Fp8Training())` from `moe_jax.fp8_training` trains in FP8.
"""),
]


MODEL = [
    md("""
# A whole model: Qwen3-MoE on `moe_jax`

`moe_jax.models.qwen3_moe` is transformers' Qwen3-MoE decoder in Flax NNX, with `moe_jax`'s `MoE`
layer as its sparse MLP. This notebook loads a tiny checkpoint written by transformers, checks
the logits against transformers', then trains it on text that ships with Python (the standard
library's docstrings) with a byte-level tokenizer, watching the loss and each layer's expert load.
Small shapes: about a minute on a laptop CPU.
"""),
    code("""
import inspect
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
import torch
import transformers
from flax import nnx

from moe_jax.models.qwen3_moe import Qwen3MoeForCausalLM, train_step

print(jax.__version__, jax.default_backend(), "transformers", transformers.__version__)
"""),
    md("""
## A checkpoint from transformers

A random Qwen3-MoE with 256 tokens (one per byte): 4 layers, layer 0 dense (`mlp_only_layers`),
layers 1-3 with 8 experts of which each token picks 2. `save_pretrained` writes config.json and
model.safetensors with the per-expert names of the Hub's checkpoints; `from_pretrained` reads them
lazily through `moe_jax.hf_loading`.
"""),
    code("""
transformers.utils.logging.disable_progress_bar()
torch.manual_seed(0)
hf_config = transformers.Qwen3MoeConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
    router_aux_loss_coef=0.01,
)
hf_model = transformers.Qwen3MoeForCausalLM(hf_config).eval()
checkpoint = tempfile.mkdtemp()
hf_model.save_pretrained(checkpoint)
print("checkpoint:", sorted(os.listdir(checkpoint)))

model = Qwen3MoeForCausalLM.from_pretrained(checkpoint)
for i, layer in enumerate(model.layers):
    print(f"layer {i}: {type(layer.mlp).__name__}")
params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
print(f"{params:,} parameters")
"""),
    md("## The same logits as transformers"),
    code("""
ids = np.random.default_rng(0).integers(0, 256, (2, 48))
with torch.no_grad():
    reference = hf_model(torch.from_numpy(ids)).logits.numpy()
logits = nnx.jit(model)(jnp.asarray(ids, jnp.int32))
error = float(np.abs(np.asarray(logits) - reference).max() / np.abs(reference).max())
print(f"logits vs transformers: max |difference| / max |logit| = {error:.1e}")
assert error < 1e-4
"""),
    md("""
## A corpus that ships with Python

The docstrings of a dozen standard-library modules and their classes and functions, as bytes:
the tokenizer is `text.encode()`. Each batch is 8 random windows of 128 bytes.
"""),
    code("""
import argparse, collections, contextlib, dataclasses, enum, functools  # noqa: E401, I001
import itertools, json, pathlib, re, string, textwrap  # noqa: E401

objects = []
for module in (argparse, collections, contextlib, dataclasses, enum, functools, itertools, json,
               pathlib, re, string, textwrap):
    objects += [module, *(obj for name, obj in vars(module).items() if not name.startswith("_")
                          and getattr(obj, "__module__", None) == module.__name__)]
docs = [doc for doc in map(inspect.getdoc, objects) if doc]
corpus = np.frombuffer("\\n\\n".join(docs).encode(), np.uint8).astype(np.int32)
print(f"{len(corpus):,} bytes from {len(docs)} docstrings")
B, S = 8, 128

def batch(step):
    starts = np.random.default_rng(step).integers(0, len(corpus) - S, B)
    return jnp.asarray(np.stack([corpus[s : s + S] for s in starts]))
"""),
    md("""
## Training

`train_step` is one `nnx.jit` program: forward, next-token cross-entropy plus
`router_aux_loss_coef` times transformers' load-balancing loss, backward through the `MoE`
layers' grouped GEMMs into the experts and, via the routing weights, the routers, and an AdamW
update. It returns the loss terms and each MoE layer's expert load (top-k choices per expert).
"""),
    code("""
STEPS = 300
optimizer = nnx.Optimizer(model, optax.adamw(optax.cosine_decay_schedule(3e-3, STEPS)),
                          wrt=nnx.Param)
history = []
start = time.perf_counter()
for step in range(STEPS):
    metrics = train_step(model, optimizer, batch(step))
    history.append(jax.tree.map(np.asarray, metrics))
print(f"{STEPS} steps in {time.perf_counter() - start:.1f} s (compilation included)")
ce = np.array([h["cross_entropy"] for h in history])
aux = np.array([h["aux_loss"] for h in history])
load = np.stack([h["expert_load"] for h in history])  # [steps, MoE layers, experts]
print(f"cross-entropy {ce[0]:.2f} -> {ce[-20:].mean():.2f} nats/byte "
      f"(uniform over bytes: {np.log(256):.2f}); aux loss {aux[0]:.3f} -> {aux[-20:].mean():.3f}")
assert ce[-20:].mean() < 0.6 * ce[0]
"""),
    md("""
## Loss and expert load per layer

The aux loss is E * sum_e f_e P_e (f_e: the share of the top-k choices that expert e gets, P_e:
its mean router probability), k = 2 when both are uniform; at `router_aux_loss_coef` = 0.01 it
nudges the routers only slightly. Right: each MoE layer's tokens per expert at every step,
relative to a balanced load.
"""),
    code("""
moe_layers = [i for i, layer in enumerate(model.layers) if layer.is_moe]
fig, axes = plt.subplots(1, 1 + len(moe_layers), figsize=(15, 3.2),
                         gridspec_kw=dict(width_ratios=[1.6] + [1] * len(moe_layers)))
axes[0].plot(ce, label="cross-entropy")
axes[0].plot(aux, label="aux loss")
axes[0].set(xlabel="step", ylabel="nats / byte", title="Training loss", ylim=(0, None))
axes[0].legend()
balanced = load.sum(-1, keepdims=True) / load.shape[-1]
for ax, j in zip(axes[1:], range(len(moe_layers)), strict=True):
    image = ax.imshow((load[:, j] / balanced[:, j]).T, aspect="auto", cmap="coolwarm",
                      vmin=0, vmax=2, interpolation="nearest")
    ax.set(title=f"layer {moe_layers[j]} expert load", xlabel="step")
axes[1].set_ylabel("expert")
fig.colorbar(image, ax=axes[1:], label="load / balanced")
plt.show()
for j, i in enumerate(moe_layers):
    last = load[-20:, j].mean(0)
    print(f"layer {i}: max/mean load over the last 20 steps {last.max() / last.mean():.2f}")
"""),
    md("""
On a GPU, `python -m moe_jax bench --model` trains a Qwen3-MoE-shaped model of about 2B
parameters this way, in bf16, against the same model with `experts="xla"` and against
transformers' own model in torch.
"""),
]


def write(name: str, cells) -> None:
    nb = new_notebook(cells=[md(INSTALL), *cells])
    stem = pathlib.Path(name).stem
    nb.cells[0].id = f"{stem}-install"
    for index, cell in enumerate(nb.cells[1:]):  # stable ids: a rebuild changes edited cells only
        cell.id = f"{stem}-{index:02d}"
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.validate(nb)
    nbformat.write(nb, HERE / name)


EXECUTED = ("05_model.ipynb",)


def execute(name: str) -> None:
    """Runs notebooks/NAME top to bottom (as its working directory) and saves its outputs."""
    import nbclient

    nb = nbformat.read(HERE / name, as_version=4)
    resources = {"metadata": {"path": str(HERE)}}
    nbclient.NotebookClient(nb, timeout=600, record_timing=False, resources=resources).execute()
    nbformat.write(nb, HERE / name)


if __name__ == "__main__":
    names = {
        "01_tour.ipynb": TOUR,
        "02_routing.ipynb": ROUTING,
        "03_performance.ipynb": PERF,
        "04_training.ipynb": TRAINING,
        "05_model.ipynb": MODEL,
    }
    for name, cells in names.items():
        write(name, cells)
    paths = [str(HERE / name) for name in names]
    # The project's formatter and linter run over the notebooks too.
    subprocess.run([sys.executable, "-m", "ruff", "format", "-q", *paths], check=True)
    subprocess.run([sys.executable, "-m", "ruff", "check", "--fix", "-q", *paths], check=True)
    for name in EXECUTED:
        execute(name)
