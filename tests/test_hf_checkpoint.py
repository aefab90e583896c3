"""Loading from checkpoint directories and transformers models in memory, against transformers.

The directories are written by transformers' `save_pretrained` (per-expert naming, sharded,
config.json as transformers 5 writes it) or by the test with safetensors (re-sharded; DeepSeek-V3
FP8). The reference is transformers' forward of the same layer; FP8 weights and their
`weight_scale_inv` are made by transformers' own FP8 quantizer, and the reference runs on them
as transformers dequantizes them (`Fp8Dequantize`, what it does loading FP8 on a CPU).
"""

from __future__ import annotations

import copy
import json
import types

import numpy as np
import pytest

transformers = pytest.importorskip(
    "transformers", reason="the reference models come from transformers (extra 'hf')"
)
torch = pytest.importorskip("torch", reason="transformers' models run in torch (extra 'hf')")
safetensors_torch = pytest.importorskip(
    "safetensors.torch", reason="checkpoint directories are safetensors files (extra 'hf')"
)
fp8_integration = pytest.importorskip(
    "transformers.integrations.finegrained_fp8",
    reason="FP8 checkpoints are made by transformers' FP8 quantizer (transformers 5)",
)

import jax.numpy as jnp  # noqa: E402
from test_hf_transformers import (  # noqa: E402
    MODEL_TYPES,
    PREFIX,
    TOL,
    block_class,
    hf_block,
    hf_config,
    hf_forward,
    per_expert,
    randomize,
    tokens,
    v4_config,
)

from moe_jax import quant  # noqa: E402
from moe_jax.hf_config import dense_layer_reason  # noqa: E402
from moe_jax.hf_loading import moe_from_hf, moe_from_pretrained  # noqa: E402

INDEX = "model.safetensors.index.json"
CAUSAL_LM = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# Layer 0 is dense for DeepSeek-V3 (first_k_dense_replace=1 in V4_CONFIG) and Qwen (set here).
DENSE_LAYER_0 = {"qwen3_moe": {"mlp_only_layers": [0]}, "qwen2_moe": {"mlp_only_layers": [0]}}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict:
    """model_type -> (a 2-layer causal LM, its save_pretrained directory in 20 KB shards)."""
    out = {}
    for model_type in MODEL_TYPES:
        torch.manual_seed(0)
        config = hf_config(model_type, **DENSE_LAYER_0.get(model_type, {}))
        model = getattr(transformers, CAUSAL_LM[model_type])(config).eval()
        randomize(model.model.layers[1].mlp, seed=2)
        path = tmp_path_factory.mktemp(model_type)
        model.save_pretrained(path, max_shard_size="20KB")
        out[model_type] = model, path
    return out


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_model_in_memory_and_its_checkpoint_directory(tiny_models, model_type):
    model, path = tiny_models[model_type]
    want = hf_forward(model.model.layers[1].mlp, tokens())
    # the model in memory (its block's own state dict: test_hf_transformers)
    in_memory = moe_from_hf(model.state_dict(), "model.layers.1.", model.config)
    np.testing.assert_allclose(np.asarray(in_memory(tokens())), want, **TOL)
    # the directory: several shards in the per-expert naming, config.json as transformers 5
    index = json.loads((path / INDEX).read_text())["weight_map"]
    assert len(set(index.values())) > 1
    down0 = (
        "block_sparse_moe.experts.0.w2" if model_type == "mixtral" else "mlp.experts.0.down_proj"
    )
    assert f"model.layers.1.{down0}.weight" in index
    from_directory = moe_from_pretrained(path, 1)
    np.testing.assert_allclose(np.asarray(from_directory(tokens())), want, **TOL)
    # which layers are MoE: as transformers' decoder layers were built
    for i, decoder_layer in enumerate(model.model.layers):
        is_moe = isinstance(decoder_layer.mlp, block_class(model_type))
        assert (dense_layer_reason(model.config, i) is None) == is_moe


def test_checkpoint_directory_opens_only_the_shards_of_that_layers_moe_block(tiny_models, tmp_path):
    """Layer 1's MoE tensors go into 3 shards, every other tensor (layer 0, layer 1's attention
    and norms, embeddings) into a 4th that is then deleted: loading layer 1 must not miss it."""
    model, saved = tiny_models["mixtral"]
    index = json.loads((saved / INDEX).read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors |= safetensors_torch.load_file(saved / shard)
    moe = sorted(k for k in tensors if k.startswith("model.layers.1.block_sparse_moe."))
    weight_map = {}
    for i, names in enumerate(np.array_split(np.array(moe), 3)):
        shard = f"moe-{i}.safetensors"
        safetensors_torch.save_file({k: tensors[k] for k in names}, tmp_path / shard)
        weight_map |= dict.fromkeys(names.tolist(), shard)
    rest = [k for k in tensors if k not in weight_map]
    assert any(k.startswith("model.layers.1.self_attn.") for k in rest)
    safetensors_torch.save_file({k: tensors[k] for k in rest}, tmp_path / "rest.safetensors")
    weight_map |= dict.fromkeys(rest, "rest.safetensors")
    index["weight_map"] = weight_map
    (tmp_path / INDEX).write_text(json.dumps(index))
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    (tmp_path / "rest.safetensors").unlink()

    layer = moe_from_pretrained(tmp_path, 1)
    x = tokens()
    np.testing.assert_allclose(
        np.asarray(layer(x)), hf_forward(model.model.layers[1].mlp, x), **TOL
    )
    # Layer 0's tensors are in the deleted shard: a read of them fails, so the above read none.
    with pytest.raises(FileNotFoundError, match="rest.safetensors.*download is incomplete"):
        moe_from_pretrained(tmp_path, 0)


def test_checkpoint_directory_errors(tiny_models, tmp_path):
    deepseek, qwen = tiny_models["deepseek_v3"][1], tiny_models["qwen3_moe"][1]
    with pytest.raises(
        ValueError, match=r"layer_index=0: .* dense MLP.*first_k_dense_replace=1.*MoE layer: 1$"
    ):
        moe_from_pretrained(deepseek, 0)
    with pytest.raises(ValueError, match=r"layer_index=0: .*dense MLP.*mlp_only_layers=\[0\]"):
        moe_from_pretrained(qwen, 0)
    with pytest.raises(
        ValueError, match=r"layer_index=5: no tensors under 'model.layers.5.'.*layers 0..1"
    ):
        moe_from_pretrained(deepseek, 5)
    with pytest.raises(ValueError, match="layer_index=-1"):
        moe_from_pretrained(deepseek, -1)
    with pytest.raises(ValueError, match=r"layers_prefix='model.layers' must end with '\.'"):
        moe_from_pretrained(deepseek, 1, layers_prefix="model.layers")
    with pytest.raises(FileNotFoundError, match="config.json"):
        moe_from_pretrained(tmp_path, 1)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text(json.dumps(v4_config("mixtral")))
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="only safetensors.*pytorch_model.bin"):
        moe_from_pretrained(tmp_path / "bin", 0)
    llama = {"model_type": "llama", "num_hidden_layers": 2}
    (tmp_path / "bin" / "config.json").write_text(json.dumps(llama))
    with pytest.raises(ValueError, match="model_type='llama'.*deepseek_v3"):
        moe_from_pretrained(tmp_path / "bin", 0)


def test_checkpoint_path_may_name_its_config_json_and_the_layer_must_be_an_int(tiny_models):
    model, path = tiny_models["qwen3_moe"]
    want = hf_forward(model.model.layers[1].mlp, tokens())
    for where in (path / "config.json", str(path / "config.json")):
        layer = moe_from_pretrained(where, np.int64(1))  # NumPy integers are ints
        np.testing.assert_allclose(np.asarray(layer(tokens())), want, **TOL)
    with pytest.raises(TypeError, match=r"layer_index='1' must be an int.*\(path, 1\)"):
        moe_from_pretrained(path, "1")  # used to be "'<' not supported between 'str' and 'int'"
    with pytest.raises(TypeError, match=r"layer_index=1\.0 must be an int"):
        moe_from_pretrained(path, 1.0)
    with pytest.raises(FileNotFoundError, match=r"generation_config\.json is a file; pass its dir"):
        moe_from_pretrained(path / "generation_config.json", 1)


# --- DeepSeek-V3 FP8 -------------------------------------------------------------------------


FP8_H = 256
FP8_QUANTIZATION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def fp8_deepseek_block():
    """(float block on transformers' dequantized FP8 weights, the FP8 block transformers 5 holds
    in memory for it (FP8Experts, FP8Linear shared experts), config). H = 256 and I = 128 give
    scale grids of 1x2 and 2x1 blocks per expert: a transposed or misplaced scale shows."""
    block, config = hf_block("deepseek_v3", seed=3, hidden=FP8_H, inter=128)
    qc = transformers.FineGrainedFP8Config(weight_block_size=(128, 128))
    quantize = fp8_integration.Fp8Quantize(types.SimpleNamespace(quantization_config=qc))
    dequantize = fp8_integration.Fp8Dequantize(None)
    float_sd = block.state_dict()
    linears = [k for k in float_sd if k.startswith(("experts.", "shared_experts."))]
    fp8_sd = float_sd | quantize.convert({k: float_sd[k] for k in linears})
    assert fp8_sd["experts.gate_up_proj"].dtype == torch.float8_e4m3fn
    assert fp8_sd["experts.down_proj_scale_inv"].shape == (8, 2, 1)

    def dequantized(k):
        """weight * its 128x128 block's scale_inv, in float32, then the block's dtype (the
        formula transformers' Fp8Dequantize applies; its convert() returns a list instead of a
        tensor in some transformers 5 releases, 5.17 among them)."""
        weight, scale = fp8_sd[k].float(), fp8_sd[k + "_scale_inv"].float()
        rows, cols = weight.shape[-2:]
        scale = scale.repeat_interleave(128, -2)[..., :rows, :]
        scale = scale.repeat_interleave(128, -1)[..., :cols]
        ours = (weight * scale).to(float_sd[k].dtype)
        theirs = dequantize.convert(
            {"weight": fp8_sd[k], "weight_scale_inv": fp8_sd[k + "_scale_inv"]}
        )
        theirs = theirs["weight"]
        if isinstance(theirs, torch.Tensor):  # the formula is transformers' where it returns one
            torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=0, atol=0)
        return ours

    block.load_state_dict(float_sd | {k: dequantized(k) for k in linears})
    holder = torch.nn.Module()  # replace_with_fp8_linear converts modules named "*.experts"
    holder.mlp, holder.config = copy.deepcopy(block), config
    fp8_integration.replace_with_fp8_linear(holder, quantization_config=qc)
    holder.mlp.load_state_dict(fp8_sd, strict=True, assign=True)
    assert type(holder.mlp.experts).__name__.startswith("FP8Experts")
    return block, holder.mlp, config


def test_deepseek_fp8_in_memory_and_checkpoint_directory(tmp_path):
    block, fp8_block, config = fp8_deepseek_block()
    x = tokens(8, hidden=FP8_H)
    want = hf_forward(block, x)
    # in memory: experts.gate_up_proj + gate_up_proj_scale_inv, shared_experts.*.weight_scale_inv
    in_memory = {PREFIX + "mlp." + k: v for k, v in fp8_block.state_dict().items()}
    assert PREFIX + "mlp.experts.gate_up_proj_scale_inv" in in_memory
    layer = moe_from_hf(in_memory, PREFIX, config)
    np.testing.assert_allclose(np.asarray(layer(x)), want, **TOL)

    # a checkpoint directory as DeepSeek-V3's: per-expert e4m3 weights, weight_scale_inv beside
    prefix = "model.layers.0."
    ckpt = per_expert(
        {k.replace(PREFIX, prefix): v for k, v in in_memory.items()}, "deepseek_v3", prefix
    )
    key = prefix + "mlp.experts.0.down_proj.weight"
    assert ckpt[key].dtype == torch.float8_e4m3fn and key + "_scale_inv" in ckpt
    safetensors_torch.save_file(ckpt, tmp_path / "model.safetensors")
    cfg = v4_config("deepseek_v3", hidden=FP8_H, inter=128, quantization_config=FP8_QUANTIZATION)
    cfg |= {"num_hidden_layers": 1, "first_k_dense_replace": 0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    dense = moe_from_pretrained(tmp_path, 0)
    assert dense.w1.dtype == jnp.float32 and dense.w1_scale is None
    np.testing.assert_allclose(np.asarray(dense(x)), want, **TOL)
    bf16 = moe_from_pretrained(tmp_path, 0, param_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(bf16.w1[...], dense.w1[...].astype(jnp.bfloat16))
    # into an FP8 layer: the checkpoint's bytes and scales, untouched
    fp8 = moe_from_pretrained(tmp_path, 0, quant_config=quant.Fp8BlockQuant())
    np.testing.assert_array_equal(
        np.asarray(fp8.w2[...][0]).view(np.uint8), ckpt[key].view(torch.uint8).numpy()
    )
    np.testing.assert_array_equal(
        np.asarray(fp8.w2_scale[...][0]), ckpt[key + "_scale_inv"].numpy()
    )
    shared_down = prefix + "mlp.shared_experts.down_proj.weight_scale_inv"
    np.testing.assert_array_equal(np.asarray(fp8.shared_w2_scale[...]), ckpt[shared_down].numpy())
