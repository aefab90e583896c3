"""moe_jax.hf_loading against transformers' own MoE blocks (CPU), with configs in every form.

Each model type's block, built by transformers with seeded random weights, is the reference: the
`MoE` loaded from its weights must give its output at float32 tolerance, from the in-memory
naming (`block.state_dict()`: fused in transformers 5) and from the per-expert checkpoint naming.
The configs start from config.json files as transformers 4 wrote them on the Hub (`V4_CONFIG`);
transformers' config class reads them (the config object) and writes them back as transformers
5 does (`to_json_string`). Checkpoint directories: tests/test_hf_checkpoint.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

transformers = pytest.importorskip(
    "transformers", reason="the reference MoE blocks come from transformers (extra 'hf')"
)
torch = pytest.importorskip("torch", reason="transformers' blocks run in torch (extra 'hf')")

from moe_jax.hf_config import dense_layer_reason  # noqa: E402
from moe_jax.hf_loading import moe_from_hf, moe_kwargs_from_hf_config  # noqa: E402

H, I, E, K = 32, 16, 8, 2  # noqa: E741 (I: intermediate size)
PREFIX = "model.layers.3."
TOL = dict(rtol=1e-5, atol=1e-5)
MODEL_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3")
CONFIG_CLASS = {
    "mixtral": "MixtralConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "deepseek_v3": "DeepseekV3Config",
}
BLOCK = {  # model_type -> the MoE block class, under transformers.models
    "mixtral": "mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "qwen3_moe": "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
    "qwen2_moe": "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "deepseek_v3": "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE",
}
_SMALL = dict(vocab_size=64, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2)
# config.json as transformers 4 wrote them on the Hub, every field kept, sizes shrunk (two
# layers; DeepSeek's first_k_dense_replace 3 -> 1): Mixtral-8x7B-v0.1 (4.36), Qwen3-30B-A3B
# (4.51), Qwen1.5-MoE-A2.7B (4.39), DeepSeek-V3 (4.33, whose quantization_config the FP8 tests
# add back).
V4_CONFIG = {
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": I,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_experts_per_tok": K,
        "num_local_experts": E,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0",
        "use_cache": True,
    }
    | _SMALL,
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": 3 * I,
        "max_position_embeddings": 40960,
        "max_window_layers": 2,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": I,
        "norm_topk_prob": True,
        "num_experts": E,
        "num_experts_per_tok": K,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
    }
    | _SMALL,
    "qwen2_moe": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": 4 * I,
        "max_position_embeddings": 8192,
        "max_window_layers": 2,
        "model_type": "qwen2_moe",
        "moe_intermediate_size": I,
        "norm_topk_prob": False,
        "num_experts": E,
        "num_experts_per_tok": K,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 4 * I,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.39.0.dev0",
        "use_cache": True,
        "use_sliding_window": False,
    }
    | _SMALL,
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": 3 * I,
        "kv_lora_rank": 16,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": I,
        "moe_layer_freq": 1,
        "n_group": 4,
        "n_routed_experts": E,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_experts_per_tok": K,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1",
        "use_cache": True,
        "v_head_dim": 8,
    }
    | _SMALL,
}


def inter_field(model_type: str) -> str:
    """The config field that holds I, the experts' intermediate size."""
    return "intermediate_size" if model_type == "mixtral" else "moe_intermediate_size"


def v4_config(model_type: str, *, hidden: int = H, inter: int = I, **fields) -> dict:
    """`V4_CONFIG[model_type]` with H, I and any other fields replaced."""
    widths = {inter_field(model_type): inter}
    if model_type == "qwen2_moe":
        widths["shared_expert_intermediate_size"] = 4 * inter
    return V4_CONFIG[model_type] | {"hidden_size": hidden} | widths | fields


def hf_config(model_type: str, **fields):
    """transformers' config object read from `v4_config(model_type, **fields)`."""
    return getattr(transformers, CONFIG_CLASS[model_type])(**v4_config(model_type, **fields))


def block_class(model_type: str):
    path, cls = BLOCK[model_type].rsplit(".", 1)
    return getattr(__import__(f"transformers.models.{path}", fromlist=[cls]), cls)


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


def hf_block(model_type: str, seed: int = 0, **fields):
    """(transformers' MoE block with seeded weights, its config object)."""
    config = hf_config(model_type, **fields)
    block = block_class(model_type)(config).eval()
    randomize(block, seed)
    return block, config


def hf_forward(block, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return block(torch.from_numpy(x)[None]).numpy()[0]


def per_expert(sd: dict, model_type: str, prefix: str = PREFIX) -> dict:
    """The checkpoint naming of a fused state dict: gate_up_proj [E, 2I, H] splits into gate rows
    and up rows per expert (Mixtral: w1, w3 under block_sparse_moe, down is w2). FP8 block scales
    `*_scale_inv` split the same way (with I a multiple of 128, each half has its own rows)."""
    if not any(k.endswith("experts.gate_up_proj") for k in sd):
        return dict(sd)  # transformers 4 keeps this naming in memory
    names, module = ("gate_proj", "up_proj", "down_proj"), prefix + "mlp."
    if model_type == "mixtral":
        names, module = ("w1", "w3", "w2"), prefix + "block_sparse_moe."
    out = {k.replace(prefix + "mlp.", module): v for k, v in sd.items() if ".experts." not in k}
    for tail in ("", "_scale_inv"):
        gate_up = sd.get(prefix + "mlp.experts.gate_up_proj" + tail)
        if gate_up is None:
            continue
        down = sd[prefix + "mlp.experts.down_proj" + tail]
        for e in range(gate_up.shape[0]):
            for name, w in zip(names, (*gate_up[e].chunk(2), down[e]), strict=True):
                out[f"{module}experts.{e}.{name}.weight{tail}"] = w.contiguous()
    return out


def block_state_dict(block, model_type: str, naming: str) -> dict:
    sd = {PREFIX + "mlp." + k: v for k, v in block.state_dict().items()}
    return sd if naming == "in_memory" else per_expert(sd, model_type)


def tokens(n: int = 12, hidden: int = H, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, hidden)).astype(np.float32)


@pytest.mark.parametrize("naming", ["in_memory", "per_expert"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_matches_transformers_block(model_type, naming):
    """In memory: the block's own state dict and config object. Per expert: the checkpoint
    naming with config.json as transformers 4 wrote it (what the Hub serves)."""
    block, config = hf_block(model_type)
    sd = block_state_dict(block, model_type, naming)
    if naming == "in_memory" and int(transformers.__version__.split(".")[0]) >= 5:
        assert PREFIX + "mlp.experts.gate_up_proj" in sd  # the fused naming is the one tested
    layer = moe_from_hf(sd, PREFIX, config if naming == "in_memory" else v4_config(model_type))
    assert (layer.shared_gate_kernel is not None) == (model_type == "qwen2_moe")
    x = tokens()
    want = hf_forward(block, x)
    assert np.abs(want).max() > 0.1  # a real signal, not a vacuous match
    np.testing.assert_allclose(np.asarray(layer(x)), want, **TOL)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_config_json_of_transformers_4_and_5_and_config_object_read_alike(model_type):
    v4 = v4_config(model_type)
    obj = hf_config(model_type)
    v5 = json.loads(obj.to_json_string())  # config.json as transformers 5 writes it
    if model_type == "qwen3_moe" and int(transformers.__version__.split(".")[0]) >= 5:
        assert "num_experts" in v4 and "num_experts" not in v5 and v5["num_local_experts"] == E
    want = moe_kwargs_from_hf_config(obj)
    assert want["num_experts"] == E and want["intermediate_size"] == I
    assert moe_kwargs_from_hf_config(v4) == want
    assert moe_kwargs_from_hf_config(v5) == want
    for layer_index in range(2):
        reasons = {dense_layer_reason(c, layer_index) for c in (v4, obj, v5)}
        assert len(reasons) == 1


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fields_a_config_json_omits_take_transformers_defaults(model_type):
    """A config.json with only the sizes reads as transformers' config class reads it (DeepSeek:
    routed_scaling_factor 2.5, n_group 8, topk_group 4, one shared expert, 3 dense layers)."""
    sizes = ["model_type", "hidden_size", "num_experts_per_tok", inter_field(model_type)]
    sizes += {"mixtral": ["num_local_experts"], "deepseek_v3": ["n_routed_experts"]}.get(
        model_type, ["num_experts"]
    )
    if model_type == "qwen2_moe":
        sizes.append("shared_expert_intermediate_size")
    minimal = {k: V4_CONFIG[model_type][k] for k in sizes}
    obj = getattr(transformers, CONFIG_CLASS[model_type])(**minimal)
    assert moe_kwargs_from_hf_config(minimal) == moe_kwargs_from_hf_config(obj)
    for layer_index in range(4):
        assert dense_layer_reason(minimal, layer_index) == dense_layer_reason(obj, layer_index)
    if model_type == "deepseek_v3":
        assert moe_kwargs_from_hf_config(minimal)["router"].routed_scaling_factor == 2.5
        assert dense_layer_reason(minimal, 2) is not None


def test_unsupported_config_objects_list_what_is_supported():
    supported = "mixtral, qwen3_moe, qwen2_moe, deepseek_v3"
    for name in ("LlamaConfig", "OlmoeConfig"):  # a dense model and an MoE model not read here
        with pytest.raises(ValueError, match=f"model_type='[a-z]+'.*supported: {supported}"):
            moe_kwargs_from_hf_config(getattr(transformers, name)())
    with pytest.raises(NotImplementedError, match="topk_method='greedy'; supported: 'noaux_tc'"):
        moe_kwargs_from_hf_config(hf_config("deepseek_v3", topk_method="greedy"))
    with pytest.raises(NotImplementedError, match="hidden_act='gelu_pytorch_tanh'.*silu, swish"):
        moe_kwargs_from_hf_config(hf_config("mixtral", hidden_act="gelu_pytorch_tanh"))
