"""Writes the exploration notebooks (outputs cleared, ruff-formatted): `python notebooks/_build.py`.

The notebooks are generated so that their code stays reviewable as Python; edit here, rerun,
commit the .ipynb files. tests/test_notebooks.py executes them.
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
]


def write(name: str, cells) -> None:
    nb = new_notebook(cells=cells)
    for index, cell in enumerate(nb.cells):  # stable ids: regenerating changes only edited cells
        cell.id = f"{pathlib.Path(name).stem}-{index:02d}"
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.validate(nb)
    nbformat.write(nb, HERE / name)


if __name__ == "__main__":
    names = {"01_tour.ipynb": TOUR, "02_routing.ipynb": ROUTING, "03_performance.ipynb": PERF}
    for name, cells in names.items():
        write(name, cells)
    paths = [str(HERE / name) for name in names]
    # The project's formatter and linter run over the notebooks too.
    subprocess.run([sys.executable, "-m", "ruff", "format", "-q", *paths], check=True)
    subprocess.run([sys.executable, "-m", "ruff", "check", "--fix", "-q", *paths], check=True)
