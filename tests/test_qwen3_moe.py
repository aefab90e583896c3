"""moe_jax.models.qwen3_moe against transformers' Qwen3MoeForCausalLM (CPU, tiny random models).

transformers builds each model with seeded random weights and writes it with `save_pretrained`
(safetensors, per-expert names); `from_pretrained` reads it back. The reference is transformers'
model in float64 (logits, losses, and its backward for every param's gradient); bf16 and FP8
loading against its float32 logits; training steps must lower the loss.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the reference is transformers' model")
torch = pytest.importorskip("torch", reason="transformers' model runs in torch")
nnx = pytest.importorskip("flax.nnx", reason="the model is Flax NNX (extra 'flax')")
optax = pytest.importorskip("optax", reason="training uses optax")

import oracles  # noqa: E402
import safetensors.numpy  # noqa: E402

from moe_jax import quant  # noqa: E402
from moe_jax.contiguous_experts import ContiguousExperts  # noqa: E402
from moe_jax.fp8_training import Fp8Training  # noqa: E402
from moe_jax.hf_checkpoint import read_hf_config  # noqa: E402
from moe_jax.models.qwen3_moe import (  # noqa: E402
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    model_loss,
    train_step,
)

B, S, VOCAB = 2, 12, 64
LOGITS_RTOL = 1e-5  # float32: |ours - transformers| <= 1e-5 * max|transformers logits| (seen 1e-6)
GRAD_RTOL = 2e-5  # float32 gradient vs float64: ||ours - ref|| <= 2e-5 ||ref|| per param (2e-6)
# Logits of bf16 params (8-bit significands) and of FP8 experts (e4m3: 4-bit significands,
# weights and activations) against transformers in float32, per max |logit| (seen 0.021, 0.037).
LOW_PRECISION_RTOL = {"bfloat16": 4e-2, "fp8": 8e-2}
SMALL = dict(vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
CONFIGS = {
    # 4 layers: 0 dense by mlp_only_layers, 2 by decoder_sparse_step=2; GQA; renormalized top-k
    "dense_and_moe": dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                          num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                          mlp_only_layers=[0], decoder_sparse_step=2, norm_topk_prob=True),
    # 3 MoE layers, tied embeddings, top-k not renormalized, padded batch
    "tied_padded": dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                        tie_word_embeddings=True, rope_theta=1e6),
    # 128-wide for FP8 expert blocks: layer 0 dense, layer 1 MoE
    "wide": dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
                 num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0]),
}  # fmt: skip


def hf_config(name: str, **changes):
    # initializer_range 0.2 (not 0.02): logits and routing far from uniform, so a wrong expert
    # or a wrong head shows.
    fields = SMALL | CONFIGS[name] | dict(initializer_range=0.2, router_aux_loss_coef=0.1)
    return transformers.Qwen3MoeConfig(**fields | changes)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """name -> (checkpoint directory, transformers model in float32)."""
    out = {}
    for i, name in enumerate(CONFIGS):
        torch.manual_seed(i)
        model = transformers.Qwen3MoeForCausalLM(hf_config(name)).eval()
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = path, model
    return out


def batch(name: str):
    """(input_ids int32[B, S], attention_mask [B, S] or None): the padded config pads row 1."""
    ids = np.random.default_rng(len(name)).integers(0, VOCAB, (B, S)).astype(np.int32)
    if name != "tied_padded":
        return ids, None
    mask = np.ones((B, S), np.int32)
    mask[1, S - 4 :] = 0
    return ids, mask


def hf_outputs(model, ids, mask):
    t = lambda a: None if a is None else torch.from_numpy(np.asarray(a)).long()  # noqa: E731
    labels = t(np.where(mask == 0, -100, ids) if mask is not None else ids)
    return model(t(ids), attention_mask=t(mask), labels=labels, output_router_logits=True)


def assert_logits_close(ours, ref, mask, rtol):
    keep = np.ones(ref.shape[:2], bool) if mask is None else mask.astype(bool)
    ours, ref = np.asarray(ours, np.float64)[keep], ref[keep]
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err <= rtol, f"max |logits error| / max |logit| = {err:.2e} > {rtol}"


@nnx.jit
def outputs_and_grads(model, ids, mask):
    grads = nnx.grad(lambda m: model_loss(m, ids, mask)[0])(model)
    return model(ids, mask, output_router_logits=True), model_loss(model, ids, mask), grads


def transformers_name(path) -> tuple[str, bool]:
    """(transformers 5's name of our param at `path`, whether its matrix is transposed)."""
    *module, leaf = map(str, path)
    if leaf in ("router_kernel", "w1", "w2"):
        experts = {"router_kernel": "gate.weight", "w1": "experts.gate_up_proj",
                   "w2": "experts.down_proj"}  # fmt: skip
        return ".".join(["model", *module, experts[leaf]]), leaf == "router_kernel"
    name = ".".join([*module, "weight"])
    return (name if module[0] == "lm_head" else f"model.{name}"), leaf == "kernel"


@pytest.mark.parametrize("name", ["dense_and_moe", "tied_padded"])
def test_logits_losses_and_gradients_match_transformers(checkpoints, name):
    """Against transformers' model in float64 (eager attention and experts): logits, router
    logits, aux loss and loss of the float32 model loaded from the checkpoint, and the gradient
    of the loss for every param (the backward of float64 torch)."""
    path, hf_model = checkpoints[name]
    model = Qwen3MoeForCausalLM.from_pretrained(path / "config.json")
    cfg = model.config
    assert [layer.is_moe for layer in model.layers] == [
        i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0
        for i in range(cfg.num_hidden_layers)
    ]
    assert (model.lm_head is None) == cfg.tie_word_embeddings
    ref_model = transformers.Qwen3MoeForCausalLM(hf_model.config).double()
    ref_model.load_state_dict(hf_model.state_dict())
    ref_model.set_attn_implementation("eager")
    ref_model.set_experts_implementation("eager")  # torch's grouped_mm has no float64
    ids, mask = batch(name)
    ref = hf_outputs(ref_model, ids, mask)
    ref.loss.backward()
    (logits, router_logits), (loss, metrics), grads = outputs_and_grads(model, ids, mask)
    assert_logits_close(logits, ref.logits.detach().numpy(), mask, LOGITS_RTOL)
    ref_router = np.stack([r.detach().numpy() for r in ref.router_logits])
    np.testing.assert_allclose(router_logits, ref_router, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(metrics["aux_loss"], ref.aux_loss.item(), rtol=1e-5)
    np.testing.assert_allclose(loss, ref.loss.item(), rtol=1e-5)
    assert metrics["expert_load"].sum() == len(cfg.moe_layers) * B * S * cfg.num_experts_per_tok
    ref_grads = {n: p.grad.numpy() for n, p in ref_model.named_parameters()}
    for path, grad in nnx.to_flat_state(grads):
        theirs, transposed = transformers_name(path)
        want = ref_grads.pop(theirs).T if transposed else ref_grads.pop(theirs)
        oracles.assert_grad_close(theirs, grad[...], want, GRAD_RTOL)  # finite, shape, error
    assert not ref_grads, f"params without a gradient check: {sorted(ref_grads)}"


@pytest.mark.parametrize("precision", list(LOW_PRECISION_RTOL))
def test_bf16_params_and_fp8_experts_load(checkpoints, precision):
    path, hf_model = checkpoints["wide"]
    kwargs = dict(dtype=jnp.bfloat16)
    if precision == "fp8":
        kwargs = dict(quant_config=quant.Fp8BlockQuant())
    model = Qwen3MoeForCausalLM.from_pretrained(path, **kwargs)
    moe = model.layers[1].mlp
    assert moe.w1.dtype == (jnp.bfloat16 if precision == "bfloat16" else quant.FP8_DTYPE)
    ids, _ = batch("wide")
    with torch.no_grad():
        ref = hf_model(torch.from_numpy(ids).long()).logits.double().numpy()
    assert_logits_close(nnx.jit(model)(ids), ref, None, LOW_PRECISION_RTOL[precision])


def test_fp8_checkpoint_loads(checkpoints, tmp_path):
    """A checkpoint with every projection (attention, dense MLP, experts) in float8_e4m3fn and
    a float32 128x128 `weight_scale_inv`, as DeepSeek's and Qwen's FP8 checkpoints (quantized
    by the numpy oracle). Reference: transformers on the dequantized weights. A float model
    dequantizes it all (float32 tolerance); FP8 experts keep its weights and scales (the FP8
    tolerance: their activations are quantized too)."""
    path, _ = checkpoints["wide"]
    fp8, dequantized = {}, {}
    for name, w in safetensors.numpy.load_file(path / "model.safetensors").items():
        fp8[name] = dequantized[name] = w
        if name.endswith("_proj.weight"):
            fp8[name], fp8[f"{name}_scale_inv"] = q, scale = oracles.per_block_quant_fp8(w)
            dequantized[name] = oracles.dequant_per_block(q, scale).astype(np.float32)
    safetensors.numpy.save_file(dequantized, tmp_path / "model.safetensors")
    config = read_hf_config(path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids, _ = batch("wide")
    with torch.no_grad():
        hf_model = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path).eval()
        ref = hf_model(torch.from_numpy(ids).long()).logits.double().numpy()
    model = Qwen3MoeForCausalLM.from_state_dict(fp8, config)
    assert model.layers[1].mlp.w1.dtype == model.layers[0].mlp.up_proj.kernel.dtype == jnp.float32
    assert_logits_close(nnx.jit(model)(ids), ref, None, LOGITS_RTOL)
    model = Qwen3MoeForCausalLM.from_state_dict(fp8, config, quant_config=quant.Fp8BlockQuant())
    scale = fp8["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"]
    np.testing.assert_array_equal(model.layers[1].mlp.w2_scale[3], scale)
    assert_logits_close(nnx.jit(model)(ids), ref, None, LOW_PRECISION_RTOL["fp8"])


def test_config_from_transformers_4_dict_and_refusals():
    v4 = dict(model_type="qwen3_moe", num_experts=16, rope_theta=1e6, rope_scaling=None,
              hidden_size=64, num_attention_heads=4, head_dim=None,
              mlp_only_layers=[1, 2])  # fmt: skip
    cfg = Qwen3MoeConfig.from_config_dict(v4)
    assert (cfg.num_experts, cfg.rope_theta, cfg.head_dim) == (16, 1e6, 16)
    assert cfg.moe_layers == tuple(i for i in range(24) if i not in (1, 2))
    assert cfg == Qwen3MoeConfig.from_config_dict(transformers.Qwen3MoeConfig(**v4))
    with pytest.raises(NotImplementedError, match="use_sliding_window"):
        Qwen3MoeConfig.from_config_dict(v4 | dict(use_sliding_window=True))
    with pytest.raises(NotImplementedError, match="RoPE scaling"):
        Qwen3MoeConfig.from_config_dict(v4 | dict(rope_scaling={"rope_type": "yarn"}))
    with pytest.raises(ValueError, match="model_type"):
        Qwen3MoeConfig.from_config_dict(v4 | dict(model_type="mixtral"))


TRAIN = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
             num_experts_per_tok=2, router_aux_loss_coef=0.01)  # fmt: skip


@pytest.mark.parametrize("recipe", ["bfloat16", "fp8_recipe"])
def test_training_lowers_the_loss(recipe):
    """20 AdamW steps on one batch of a random one-layer model with bf16 params: the loss falls
    to under half its start (near ln(64) = 4.2; a model that learns nothing stays there).
    float32 steps: test_gradient_matches_transformers_float64_backward and notebook 05."""
    experts = ContiguousExperts(recipe=Fp8Training()) if recipe == "fp8_recipe" else "auto"
    model = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(**TRAIN), param_dtype=jnp.bfloat16, experts=experts, rngs=nnx.Rngs(0)
    )
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, VOCAB, (4, 32)), jnp.int32)
    losses = [float(train_step(model, optimizer, ids)["loss"]) for _ in range(20)]
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0], losses
    assert model.layers[0].mlp.w1.dtype == jnp.bfloat16
    if recipe == "fp8_recipe":  # the experts' GEMMs ran on float8 operands
        assert "f8_e4m3fn" in str(jax.make_jaxpr(lambda: model_loss(model, ids)[0])())


def test_model_bench_at_the_tiny_preset(tmp_path, capsys):
    """`bench --model` on the CPU: every row trains the tiny preset from transformers' weights
    with the same first-step loss; its FLOP count is 6 x tokens x the active matmul params
    (routed experts counted k/E) plus causal attention's 6 B S^2 N D per layer."""
    from moe_jax.__main__ import main
    from moe_jax.cli.model_bench import DEFAULT_VARIANTS, PRESETS, step_flops

    path = tmp_path / "model.json"
    argv = ["bench", "--model", "--shapes", "tiny", "--iters", "1", "--json", str(path)]
    assert main(argv) == 0
    rows = {r["variant"]: r for r in json.loads(path.read_text())["rows"]}
    assert sorted(rows) == sorted(DEFAULT_VARIANTS) and all("step ms" in r for r in rows.values())
    assert all(r["loss error"] <= 1e-4 and r["moe ms"] > 0 for r in rows.values())
    assert "experts_implementation='grouped_mm'" in capsys.readouterr().out

    preset = PRESETS["tiny"]
    cfg = Qwen3MoeConfig.from_config_dict(preset.config)
    model = nnx.eval_shape(lambda: Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))
    share = cfg.num_experts_per_tok / cfg.num_experts
    active = sum(
        v.size * (share if path[-1] in ("w1", "w2") else 1)
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if path[-1] not in ("embedding", "weight")  # lookups and norms: no matmul
    )
    b, s, layers = preset.batch, preset.seq, cfg.num_hidden_layers
    attention = 6 * b * s * s * cfg.num_attention_heads * cfg.head_dim * layers
    assert step_flops(cfg, b, s) == pytest.approx(6 * b * s * active + attention)
    if jax.default_backend() != "gpu":
        assert main(["bench", "--model", "--shapes", "qwen3-2b"]) == 2
