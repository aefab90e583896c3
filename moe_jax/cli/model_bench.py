"""`python -m moe_jax bench --model`: training steps of a whole Qwen3-MoE model, moe_jax against
`jax.lax.ragged_dot` and against transformers' own model in torch, on the same weights and batch.

Rows:
  moe_jax       `moe_jax.models.qwen3_moe` with experts="auto", `train_step` (AdamW, one nnx.jit)
  ragged_dot    the same model, its experts as a JAX user writes them: argsort by expert, two
                jax.lax.ragged_dot, unsort (`RaggedDotExperts`)
  transformers  transformers' Qwen3MoeForCausalLM in torch, eager (no torch.compile), sdpa
                attention, torch AdamW (fused on CUDA), the first of `TORCH_EXPERTS` whose
                backward reaches the expert weights here (deepgemm has none: not a candidate)
  moe_jax_xla   (opt-in) the model with experts="xla", moe_jax's XLA reference (a loop over
                16-row blocks)

transformers initializes the weights (seeded); the JAX rows load its `state_dict()` through
`Qwen3MoeForCausalLM.from_state_dict`. On a GPU the JAX rows run cuDNN attention (XLA's where
cuDNN refuses; the notes say which). Correctness first: each row's loss of the first step (before
its update) must match transformers' within `LOSS_RTOL`, else the exit status is 1.

Columns: step ms (median of back-to-back steps, `moe_jax.cli.timing`), tokens/s, MoE ms (forward
and backward of one MoE block alone on the step's tokens, times the number of MoE layers), its
share of the step, MFU (model FLOPs per step, `step_flops`, over the step time and the GPU's dense
bf16 peak), the first step (compilation included), and the transformers step time over the row's.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import time
from collections.abc import Sequence
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.cli import layer_report
from moe_jax.cli.timing import time_calls
from moe_jax.cli.tokamax_peer import sorted_moe, to_kn
from moe_jax.experts import Experts

VARIANTS = ("moe_jax", "ragged_dot", "transformers", "moe_jax_xla")
DEFAULT_VARIANTS = VARIANTS[:3]
BASELINE = "transformers"
# transformers' experts implementations that have a backward, the expected fastest first.
TORCH_EXPERTS = ("sonicmoe", "grouped_mm")
LOSS_RTOL = {"bfloat16": 2e-2, "float32": 1e-4}  # first-step loss vs transformers', relative
LEARNING_RATE = 3e-4
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"  # JAX takes 75% of the GPU up front unless "false"
# Dense bf16 tensor-core peak by device name (first match; NVIDIA's datasheets).
BF16_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset:
    """A model (transformers `Qwen3MoeConfig` fields) and the batch one step trains on."""

    config: dict
    batch: int
    seq: int
    dtype: str
    is_gpu_only: bool

    def __str__(self) -> str:
        c = self.config
        return (
            f"{c['num_hidden_layers']} layers H={c['hidden_size']} E={c['num_experts']} "
            f"k={c['num_experts_per_tok']} I={c['moe_intermediate_size']} B={self.batch} "
            f"S={self.seq} {self.dtype}"
        )


# Qwen3-30B-A3B's layer with 64 of its 128 experts, 6 layers, a 32k vocabulary: 2.1B params
_QWEN3_2B = dict(
    hidden_size=2048, moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=32768,
    num_hidden_layers=6, num_experts=64,
)  # fmt: skip
# the CPU test vehicle: one MoE layer, float32
_TINY = dict(
    vocab_size=128, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
)  # fmt: skip
PRESETS = {
    "qwen3-2b": Preset(config=_QWEN3_2B, batch=4, seq=2048, dtype="bfloat16", is_gpu_only=True),
    "tiny": Preset(config=_TINY, batch=2, seq=16, dtype="float32", is_gpu_only=False),
}


class RaggedDotExperts(Experts):
    """The experts through `jax.lax.ragged_dot` (`tokamax_peer.sorted_moe`): float weights, no
    expert parallelism; XLA differentiates it."""

    def apply(self, prepared, weights, *, expert_map, call):
        if expert_map is not None or weights.is_fp8 or call.quant_config is not None:
            raise NotImplementedError("RaggedDotExperts runs float weights without expert_map")
        w1, w2 = to_kn(weights.w1, weights.w2)
        return sorted_moe(
            prepared.x, w1, w2, prepared.topk_weights, prepared.topk_ids, ragged_dot=_ragged_dot
        )


def _ragged_dot(rows, w, sizes):
    return jax.lax.ragged_dot(rows, w, sizes, preferred_element_type=rows.dtype)


EXPERTS = {"moe_jax": "auto", "ragged_dot": RaggedDotExperts(), "moe_jax_xla": "xla"}


def step_flops(cfg, batch: int, seq: int) -> float:
    """Model FLOPs of one training step (forward 2, backward 4 per multiply-add): the matmuls
    of the attention projections, routers, k experts or dense MLPs and LM head per token, and
    causal attention's half of QK^T and PV (2 S^2 N D per sequence and layer, forward)."""
    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    attention = h * d * 2 * (cfg.num_attention_heads + cfg.num_key_value_heads)
    moe = h * cfg.num_experts + 3 * cfg.num_experts_per_tok * h * cfg.moe_intermediate_size
    dense = 3 * h * cfg.intermediate_size
    mlps = sum(moe if cfg.is_moe_layer(i) else dense for i in range(layers))
    per_token = layers * attention + mlps + h * cfg.vocab_size
    scores = 2 * seq * seq * cfg.num_attention_heads * d * layers
    return 6.0 * batch * seq * per_token + 3.0 * batch * scores


def peak_flops(device_kind: str) -> float | None:
    """The dense bf16 peak of a GPU by JAX's device_kind, None if not in the table."""
    return next((t * 1e12 for name, t in BF16_PEAK_TFLOPS if name in device_kind), None)


def _timed(call, wait, iters: int):
    """(ms per call, back to back) after warm-up; `iters` calls in bursts of up to 10."""
    burst = min(10, iters)
    return time_calls(call, wait=wait, samples=max(1, iters // burst), burst=burst).streamed_ms


def _torch_model(preset: Preset, ids, device: str):
    """(transformers model, its experts implementation, why others were passed over)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**preset.config)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, preset.dtype), attn_implementation="sdpa"
        ).to(device)
    refused = {}
    for name in TORCH_EXPERTS:
        try:
            model.set_experts_implementation(name)
            model(ids, labels=ids).loss.backward()
            grads = [p.grad for n, p in model.named_parameters() if ".experts." in n]
            if any(g is None or not g.abs().sum().item() for g in grads):
                raise RuntimeError("its backward leaves the expert weights without gradients")
            model.zero_grad(set_to_none=True)
            return model, name, refused
        except Exception as error:  # a kernel missing here: say why, try the next
            model.zero_grad(set_to_none=True)
            refused[name] = layer_report.skip_reason(error, limit=120)
    raise RuntimeError(f"no experts implementation of transformers trains here: {refused}")


def run_torch(model, ids, *, iters: int) -> dict:
    import torch

    on_gpu = ids.is_cuda
    wait = (lambda _: torch.cuda.synchronize()) if on_gpu else (lambda _: None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=on_gpu)

    def step():
        loss = model(ids, labels=ids, output_router_logits=True).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    start = time.perf_counter()
    row = {"loss": step().item(), "first step s": time.perf_counter() - start}
    row["step ms"] = _timed(step, wait, iters)
    cfg = model.config
    moe = [i for i in range(cfg.num_hidden_layers) if hasattr(model.model.layers[i].mlp, "gate")]
    if moe:
        block = model.model.layers[moe[0]].mlp
        x = torch.randn(*ids.shape, cfg.hidden_size, device=ids.device, dtype=model.dtype)
        x.requires_grad_(True)
        row["moe ms"] = len(moe) * _timed(lambda: block(x).float().sum().backward(), wait, iters)
    return row


def run_jax(name: str, weights: dict, preset: Preset, ids, *, iters: int) -> dict:
    import optax
    from flax import nnx

    from moe_jax.models.qwen3_moe import Qwen3MoeForCausalLM, train_step

    on_gpu = jax.default_backend() == "gpu"
    dtype, refused = jnp.dtype(preset.dtype), {}
    for attention in ("cudnn", None) if on_gpu else (None,):
        model = Qwen3MoeForCausalLM.from_state_dict(
            weights, preset.config, dtype=dtype, experts=EXPERTS[name], attention_impl=attention
        )
        optimizer = nnx.Optimizer(model, optax.adamw(LEARNING_RATE), wrt=nnx.Param)
        step = nnx.cached_partial(train_step, model, optimizer)
        start = time.perf_counter()
        try:
            loss = float(step(ids)["loss"])
            break
        except Exception as error:  # cuDNN refused the attention: XLA's runs next
            refused[attention] = layer_report.skip_reason(error, limit=120)
            if attention is None:
                raise
    row = {"loss": loss, "first step s": time.perf_counter() - start}
    row["attention"] = attention or "xla"
    if refused:
        row["attention note"] = f"cudnn refused: {refused['cudnn']}"
    row["step ms"] = _timed(lambda: step(ids), jax.block_until_ready, iters)
    moe = model.config.moe_layers
    if moe:
        x = jax.random.normal(jax.random.PRNGKey(1), (ids.size, model.config.hidden_size), dtype)
        grad = nnx.jit(nnx.grad(lambda m, x: m(x).astype(jnp.float32).sum(), argnums=(0, 1)))
        block = model.layers[moe[0]].mlp
        ms = _timed(lambda: grad(block, x), jax.block_until_ready, iters)
        row["moe ms"] = len(moe) * ms
    return row


def _free_torch_memory(on_gpu: bool) -> None:
    """Collects dropped torch tensors and hands torch's cached GPU memory back."""
    import torch

    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()


def run(preset_name: str, variants, *, iters: int, progress: TextIO | None = None) -> dict:
    """{"preset", "notes", "rows"}: a row per variant (times, loss) or with "skipped"."""
    import torch

    from moe_jax.hf_weights import to_numpy
    from moe_jax.models.qwen3_moe import Qwen3MoeConfig

    progress = sys.stderr if progress is None else progress
    preset = PRESETS[preset_name]
    cfg = Qwen3MoeConfig.from_config_dict(preset.config)
    on_gpu = jax.default_backend() == "gpu"
    device = "cuda" if on_gpu else "cpu"
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (preset.batch, preset.seq)).astype(np.int32)
    ids_torch = torch.from_numpy(ids).long().to(device)
    print(f"[{preset}] transformers builds the weights", file=progress, flush=True)
    model, experts_impl, refused = _torch_model(preset, ids_torch, device)
    # copies: on the CPU to_numpy shares the tensors' memory, which the torch row then trains
    weights = {k: np.copy(to_numpy(v)) for k, v in model.state_dict().items()}
    notes = [f"transformers: experts_implementation={experts_impl!r}, sdpa, eager"]
    notes += [f"transformers {n!r} passed over: {why}" for n, why in refused.items()]
    if BASELINE not in variants:
        model = None
        _free_torch_memory(on_gpu)
    rows = {}
    # transformers first: then its model goes and the JAX rows have the GPU
    for step, name in enumerate(sorted(variants, key=lambda v: v != BASELINE), 1):
        print(f"[{step}/{len(variants)}] {name}", file=progress, flush=True)
        try:
            if name == BASELINE:
                row = run_torch(model, ids_torch, iters=iters)
            else:
                row = run_jax(name, weights, preset, jnp.asarray(ids), iters=iters)
        except Exception as error:  # e.g. out of memory: report, go on
            row = {"skipped": f"failed: {layer_report.skip_reason(error)}"}
        rows[name] = {"shape": preset_name, "variant": name, **row}
        if name == BASELINE:
            model = None  # then collected: its GPU memory goes back for the JAX rows
            _free_torch_memory(on_gpu)
    rows = [rows[name] for name in variants]
    flops, peak = step_flops(cfg, preset.batch, preset.seq), None
    if on_gpu:
        peak = peak_flops(jax.devices()[0].device_kind)
    base = next((r for r in rows if r["variant"] == BASELINE and "step ms" in r), None)
    for row in (r for r in rows if "step ms" in r):
        row["tokens/s"] = ids.size / row["step ms"] * 1e3
        if "moe ms" in row:
            row["moe share"] = row["moe ms"] / row["step ms"]
        if peak:
            row["mfu"] = flops / (row["step ms"] * 1e-3) / peak
        if base is not None:
            row["loss error"] = abs(row["loss"] - base["loss"]) / abs(base["loss"])
            row[f"x {BASELINE}"] = base["step ms"] / row["step ms"]
        if "attention" in row:
            why = f" ({row.pop('attention note')})" if "attention note" in row else ""
            notes.append(f"{row['variant']}: {row['attention']} attention{why}")
    total = sum(int(np.prod(v.shape)) for v in weights.values())
    notes.append(
        f"{total / 1e9:.2f}B params, {flops / 1e12:.1f} TFLOP per step"
        + (f", MFU against {peak / 1e12:.0f} TFLOPS bf16" if peak else ", no MFU: peak unknown")
    )
    return {"preset": dataclasses.asdict(preset), "notes": notes, "rows": rows}


# (row key, header, format)
COLUMNS = (
    ("loss", "loss", ".4f"),
    ("loss error", "loss err", ".1e"),
    ("step ms", "step ms", ".2f"),
    ("tokens/s", "tokens/s", ",.0f"),
    ("moe ms", "MoE ms", ".2f"),
    ("moe share", "MoE %", ".0%"),
    ("mfu", "MFU", ".1%"),
    ("first step s", "1st step s", ".1f"),
    (f"x {BASELINE}", f"x {BASELINE}", ".2f"),
)


def format_table(result: dict) -> str:
    """One line per row of `run`, as `bench`'s tables; skip reasons and notes below."""
    rows = result["rows"]
    lines = layer_report.column_table(
        rows, COLUMNS, f"{'variant':<13}", lambda row: f"{row['variant']:<13}", 9
    )
    lines += result["notes"]
    lines.append(
        "loss: the first step's, before its update; loss err: relative to transformers'. "
        "MoE ms: one MoE block's forward + backward alone x the MoE layers."
    )
    return "\n".join(lines)


def run_model_bench(
    *,
    shapes: Sequence[str] | None = None,
    variants: Sequence[str] | None = None,
    iters: int = 20,
    json_path: str | None = None,
    plot_path: str | None = None,
    progress: TextIO | None = None,
) -> int:
    """The `bench --model` command: runs, prints the table, writes JSON/PNG; returns the exit
    status (1 where a row's first-step loss is off transformers' by more than `LOSS_RTOL`).

    Args:
      shapes: one name of `PRESETS` (None: "qwen3-2b" on a GPU, "tiny" elsewhere).
      variants: names of `VARIANTS` (None: `DEFAULT_VARIANTS`).
      iters: timed steps per row (and timed MoE blocks), after two warm-up steps.
      json_path, plot_path: also write {"environment", "preset", "notes", "rows"} / a PNG.
      progress: where a line per row goes as it starts (None: sys.stderr).
    """
    on_gpu = jax.default_backend() == "gpu"
    names = list(shapes or (["qwen3-2b"] if on_gpu else ["tiny"]))
    variants = list(variants or DEFAULT_VARIANTS)
    problems = [
        f"unknown preset {n!r}; choose from {list(PRESETS)}" for n in names if n not in PRESETS
    ]
    problems += [
        f"unknown variant {v!r}; choose from {list(VARIANTS)}"
        for v in variants
        if v not in VARIANTS
    ]
    if len(names) != 1:
        problems.append(f"--model runs one preset at a time, not {names}")
    elif names[0] in PRESETS and PRESETS[names[0]].is_gpu_only and not on_gpu:
        problems.append(
            f"preset {names[0]!r} needs a GPU (JAX runs on {jax.default_backend()}); "
            "'tiny' runs here"
        )
    if on_gpu and BASELINE in variants and os.environ.get(PREALLOCATE) != "false":
        problems.append(
            f"torch shares the GPU with JAX here: run with {PREALLOCATE}=false (or leave "
            f"{BASELINE} out of --variants)"
        )
    try:
        import optax  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from flax import nnx  # noqa: F401
    except ImportError as error:
        problems.append(
            f"bench --model needs flax, optax, torch and transformers ({error}): "
            "pip install 'moe_jax[hf]' optax"
        )
    if problems:
        print(problems[0], file=sys.stderr)
        return 2
    result = run(names[0], variants, iters=iters, progress=progress)
    env = layer_report.environment()
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(format_table(result))
    tol = LOSS_RTOL[PRESETS[names[0]].dtype]
    wrong = [r["variant"] for r in result["rows"] if r.get("loss error", 0.0) > tol]
    status = layer_report.write_outputs(
        dict(environment=env, **result),
        json_path=json_path,
        plot_path=plot_path,
        draw=lambda path: layer_report.plot(
            result["rows"], path, shapes={names[0]: PRESETS[names[0]]}, baselines=(BASELINE,),
            value_key="step ms", xlabel="ms per training step of the whole model, lower is better",
        ),
    )  # fmt: skip
    if wrong:
        print(
            f"first-step loss of {wrong} differs from transformers' by more than {tol}",
            file=sys.stderr,
        )
        return 1
    return status
