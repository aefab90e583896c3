"""moe_jax.hf_loading against transformers' own MoE blocks and checkpoint directories (CPU).

Each model type's block, built by transformers with seeded random weights, is the reference: the
`MoE` loaded from its weights must give its output at float32 tolerance, from the in-memory
naming (`block.state_dict()`: fused in transformers 5) and the per-expert checkpoint naming. The
checkpoint directories are written by transformers' `save_pretrained` (which writes the
per-expert naming, sharded) and by hand with safetensors (DeepSeek-V3 FP8).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

transformers = pytest.importorskip(
    "transformers", reason="the reference MoE blocks come from transformers (extra 'hf')"
)
torch = pytest.importorskip("torch", reason="transformers' blocks run in torch (extra 'hf')")
safetensors_torch = pytest.importorskip(
    "safetensors.torch", reason="checkpoint directories are written with safetensors (extra 'hf')"
)

import jax.numpy as jnp  # noqa: E402

from moe_jax import quant  # noqa: E402
from moe_jax.hf_loading import (  # noqa: E402
    moe_from_hf,
    moe_from_pretrained,
)

H, I, E, K = 32, 16, 8, 2  # noqa: E741 (I: intermediate size)
PREFIX = "model.layers.3."
TOL = dict(rtol=1e-5, atol=1e-5)
MODEL = {  # model_type -> (config class, block class path in transformers.models)
    "mixtral": ("MixtralConfig", "mixtral.modeling_mixtral.MixtralSparseMoeBlock"),
    "qwen3_moe": ("Qwen3MoeConfig", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"),
    "qwen2_moe": ("Qwen2MoeConfig", "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock"),
    "deepseek_v3": ("DeepseekV3Config", "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE"),
}
ATTENTION = dict(vocab_size=64, num_attention_heads=2, num_key_value_heads=2)
DEEPSEEK_ATTENTION = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8)
DEEPSEEK_ATTENTION |= dict(qk_nope_head_dim=8, v_head_dim=8)


def hf_config(model_type: str, *, hidden=H, inter=I, **extra):
    """A tiny transformers config of `model_type` (4 groups of 2 experts for DeepSeek-V3)."""
    common = dict(hidden_size=hidden, num_experts_per_tok=K, **ATTENTION)
    fields = {
        "mixtral": dict(intermediate_size=inter, num_local_experts=E),
        "qwen3_moe": dict(moe_intermediate_size=inter, num_experts=E, norm_topk_prob=True),
        "qwen2_moe": dict(
            moe_intermediate_size=inter, num_experts=E, shared_expert_intermediate_size=2 * inter
        ),
        "deepseek_v3": dict(
            moe_intermediate_size=inter,
            intermediate_size=3 * inter,
            n_routed_experts=E,
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            routed_scaling_factor=2.5,
            **DEEPSEEK_ATTENTION,
        ),
    }[model_type]
    return getattr(transformers, MODEL[model_type][0])(**common | fields | extra)


def randomize(module, seed: int) -> None:
    """Seeded weights of unit scale per output (the default init would make outputs ~1e-4)."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            fan_in = p.shape[-1]
            p.copy_(torch.from_numpy(rng.normal(size=tuple(p.shape)) / np.sqrt(fan_in)))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.from_numpy(rng.uniform(-0.1, 0.1, b.shape)))


def hf_block(model_type: str, seed: int = 0, **config_fields):
    path, cls = MODEL[model_type][1].rsplit(".", 1)
    config = hf_config(model_type, **config_fields)
    module = __import__(f"transformers.models.{path}", fromlist=[cls])
    block = getattr(module, cls)(config).eval()
    randomize(block, seed)
    return block, config


def hf_forward(block, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return block(torch.from_numpy(x)[None]).numpy()[0]


def per_expert(sd: dict, model_type: str) -> dict:
    """The checkpoint naming of a fused block state dict: gate_up_proj [E, 2I, H] splits into
    gate rows and up rows per expert (Mixtral: w1, w3 under block_sparse_moe, down is w2)."""
    if not any(k.endswith("experts.gate_up_proj") for k in sd):
        return dict(sd)  # transformers 4 keeps this naming in memory
    names, module = ("gate_proj", "up_proj", "down_proj"), PREFIX + "mlp."
    if model_type == "mixtral":
        names, module = ("w1", "w3", "w2"), PREFIX + "block_sparse_moe."
    out = {k.replace(PREFIX + "mlp.", module): v for k, v in sd.items() if ".experts." not in k}
    gate_up, down = sd[PREFIX + "mlp.experts.gate_up_proj"], sd[PREFIX + "mlp.experts.down_proj"]
    for e in range(gate_up.shape[0]):
        for name, w in zip(names, (*gate_up[e].chunk(2), down[e]), strict=True):
            out[f"{module}experts.{e}.{name}.weight"] = w
    return out


def block_state_dict(block, model_type: str, naming: str) -> dict:
    sd = {PREFIX + "mlp." + k: v for k, v in block.state_dict().items()}
    return sd if naming == "in_memory" else per_expert(sd, model_type)


def tokens(n: int = 12, hidden: int = H, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, hidden)).astype(np.float32)


@pytest.mark.parametrize("naming", ["in_memory", "per_expert"])
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_matches_transformers_block(model_type, naming):
    block, config = hf_block(model_type)
    sd = block_state_dict(block, model_type, naming)
    # in-memory models pass their config object; checkpoints come with config.json's dict
    cfg = config if naming == "in_memory" else json.loads(config.to_json_string())
    layer = moe_from_hf(sd, PREFIX, cfg)
    x = tokens()
    want = hf_forward(block, x)
    assert np.abs(want).max() > 0.1  # a real signal, not a vacuous match
    np.testing.assert_allclose(np.asarray(layer(x)), want, **TOL)


@pytest.mark.parametrize("naming", ["in_memory", "per_expert"])
def test_qwen2_moe_with_gated_shared_expert_matches_transformers(naming):
    """Qwen2-MoE: routed experts plus sigmoid(x @ gate) * shared MLP, as transformers' block."""
    block, config = hf_block("qwen2_moe")
    sd = block_state_dict(block, "qwen2_moe", naming)
    layer = moe_from_hf(sd, PREFIX, config)
    assert layer.shared_gate_kernel is not None and layer.num_shared_experts == 2
    x = tokens()
    np.testing.assert_allclose(np.asarray(layer(x)), hf_forward(block, x), **TOL)


# --- checkpoint directories ----------------------------------------------------------------


CAUSAL_LM = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def save_tiny_model(model_type: str, path, **extra) -> object:
    """A 2-layer causal LM saved with save_pretrained in small shards; layer 1 is MoE."""
    extra = dict(num_hidden_layers=2) | extra
    if model_type == "deepseek_v3":
        extra.setdefault("first_k_dense_replace", 1)
    config = hf_config(model_type, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, CAUSAL_LM[model_type])(config).eval()
    randomize(model.model.layers[1].mlp, seed=2)
    model.save_pretrained(path, max_shard_size="20KB")
    return model


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_checkpoint_directory_matches_transformers(model_type, tmp_path):
    model = save_tiny_model(model_type, tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1  # read shard by shard
    # transformers writes the per-expert checkpoint naming, not its in-memory fused one
    down0 = {"mixtral": "block_sparse_moe.experts.0.w2.weight"}.get(
        model_type, "mlp.experts.0.down_proj.weight"
    )
    assert "model.layers.1." + down0 in index["weight_map"]
    layer = moe_from_pretrained(tmp_path, 1)
    x = tokens()
    np.testing.assert_allclose(
        np.asarray(layer(x)), hf_forward(model.model.layers[1].mlp, x), **TOL
    )


def test_checkpoint_directory_errors(tmp_path):
    save_tiny_model("deepseek_v3", tmp_path / "ds")
    with pytest.raises(ValueError, match="layer 0 .* dense MLP.*first_k_dense_replace=1"):
        moe_from_pretrained(tmp_path / "ds", 0)
    with pytest.raises(ValueError, match=r"no tensors under 'model.layers.5.'.*layers 0..1"):
        moe_from_pretrained(tmp_path / "ds", 5)
    with pytest.raises(ValueError, match="layer_index=-1"):
        moe_from_pretrained(tmp_path / "ds", -1)
    with pytest.raises(FileNotFoundError, match="config.json"):
        moe_from_pretrained(tmp_path, 1)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text(hf_config("mixtral").to_json_string())
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="only safetensors.*pytorch_model.bin"):
        moe_from_pretrained(tmp_path / "bin", 0)
    llama = {"model_type": "llama", "num_hidden_layers": 2}
    (tmp_path / "bin" / "config.json").write_text(json.dumps(llama))
    with pytest.raises(ValueError, match="model_type='llama'.*deepseek_v3"):
        moe_from_pretrained(tmp_path / "bin", 0)


def test_deepseek_fp8_checkpoint_directory(tmp_path):
    """DeepSeek-V3's FP8 layout, written by hand as one model.safetensors: e4m3 weights with
    float32 128x128 `weight_scale_inv` beside them, and quantization_config in config.json."""
    hidden = 128
    block, config = hf_block("deepseek_v3", seed=3, hidden=hidden, inter=128, n_shared_experts=1)
    prefix = "model.layers.0."
    sd = block_state_dict(block, "deepseek_v3", "per_expert")  # views of block's weights
    sd = {k.replace(PREFIX, prefix): v for k, v in sd.items()}
    tensors = {}
    with torch.no_grad():
        for k, v in sd.items():
            if ".experts." in k or ".shared_experts." in k:
                wq, s = quant.per_block_quant_fp8(jnp.asarray(v.numpy()))
                wq8 = torch.from_numpy(np.asarray(wq).view(np.uint8).copy()).view(
                    torch.float8_e4m3fn
                )
                tensors[k], tensors[k + "_scale_inv"] = wq8, torch.from_numpy(np.array(s))
                # the reference runs on exactly the weights the FP8 checkpoint holds
                v.copy_(torch.from_numpy(np.array(quant.dequant_per_block(wq, s))))
            else:
                tensors[k] = v.contiguous()
    safetensors_torch.save_file(tensors, tmp_path / "model.safetensors")
    cfg = json.loads(config.to_json_string()) | {"num_hidden_layers": 1, "first_k_dense_replace": 0}
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    dense = moe_from_pretrained(tmp_path, 0)
    assert dense.w1.dtype == jnp.float32 and dense.w1_scale is None
    x = tokens(8, hidden=hidden)  # the shapes of test_hf_loading.test_fp8_checkpoint: one compile
    np.testing.assert_allclose(np.asarray(dense(x)), hf_forward(block, x), **TOL)
    fp8 = moe_from_pretrained(tmp_path, 0, quant_config=quant.Fp8BlockQuant())
    down0 = tensors[prefix + "mlp.experts.0.down_proj.weight"].view(torch.uint8).numpy()
    np.testing.assert_array_equal(np.asarray(fp8.w2[...][0]).view(np.uint8), down0)
    np.testing.assert_array_equal(
        np.asarray(fp8.w2_scale[...][0]),
        tensors[prefix + "mlp.experts.0.down_proj.weight_scale_inv"].numpy(),
    )
