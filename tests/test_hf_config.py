"""moe_jax.hf_config and hf_weights namings, on numpy only: config fields per model type, dense
layers, the fused transformers-5 naming of an FP8 checkpoint, Qwen2-MoE's shared expert and its
gate. transformers 4 and 5 config spellings and the float fused naming against transformers'
own classes and blocks: tests/test_hf_transformers.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_hf_loading import PREFIX, make_config, make_state_dict

from moe_jax import quant
from moe_jax.hf_config import dense_layer_reason
from moe_jax.hf_loading import (
    detect_hf_naming,
    hf_moe_params,
    moe_from_hf,
    moe_kwargs_from_hf_config,
)


def test_kwargs_per_model_type():
    qwen2 = make_config(
        "qwen2_moe", shared_expert_intermediate_size=48, norm_topk_prob=True, hidden_act="gelu"
    )
    kw = moe_kwargs_from_hf_config(qwen2)
    assert (kw["intermediate_size"], kw["num_shared_experts"], kw["activation"]) == (16, 3, "gelu")
    assert kw["router"].renormalize and not kw["router"].is_grouped
    ds = moe_kwargs_from_hf_config(make_config("deepseek_v3"))
    r = ds["router"]
    assert (r.scoring_func, r.num_expert_group, r.topk_group) == ("sigmoid", 4, 2)
    assert (
        r.use_correction_bias and r.routed_scaling_factor == 2.5 and ds["num_shared_experts"] == 2
    )
    assert moe_kwargs_from_hf_config(make_config("mixtral"))["router"].renormalize
    with pytest.raises(NotImplementedError, match="not a multiple of moe_intermediate_size=16"):
        moe_kwargs_from_hf_config(make_config("qwen2_moe", shared_expert_intermediate_size=40))
    # absent optional fields take transformers' defaults (tests/test_hf_transformers.py, against
    # its config classes); required sizes are refused with their name
    with pytest.raises(ValueError, match="lacks 'shared_expert_intermediate_size'"):
        moe_kwargs_from_hf_config(make_config("qwen2_moe"))


def test_dense_layer_reason():
    ds = make_config("deepseek_v3", first_k_dense_replace=3)
    assert [dense_layer_reason(ds, i) is None for i in range(5)] == [False] * 3 + [True] * 2
    assert "first_k_dense_replace=3" in dense_layer_reason(ds, 0)
    assert "moe_layer_freq=2" in dense_layer_reason(ds | {"moe_layer_freq": 2}, 5)
    qwen = make_config("qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[3])
    assert [dense_layer_reason(qwen, i) is None for i in range(4)] == [False, True, False, False]
    assert "mlp_only_layers=[3]" in dense_layer_reason(qwen, 3)
    assert dense_layer_reason(make_config("mixtral"), 0) is None


def to_fused(sd: dict, model_type: str) -> dict:
    """The transformers-5 in-memory naming of a per-expert state dict (its MergeModulelist +
    Concatenate(dim=1) conversion), written independently of moe_jax.hf_weights."""
    projs = ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    src = PREFIX + ("block_sparse_moe." if model_type == "mixtral" else "mlp.")
    out, experts = {}, {}
    for k, v in sd.items():
        if not k.startswith(src + "experts."):
            out[k.replace(src, PREFIX + "mlp.")] = v
            continue
        e, proj, tail = k[len(src + "experts.") :].split(".", 2)
        experts[int(e), proj, tail] = v
    num_experts = 1 + max(e for e, _, _ in experts)
    for tail in sorted({t for _, _, t in experts}):  # "weight", and "weight_scale_inv" if FP8
        suffix = "" if tail == "weight" else tail.removeprefix("weight")
        gate_up = [
            np.concatenate([experts[e, projs[0], tail], experts[e, projs[1], tail]])
            for e in range(num_experts)
        ]
        out[PREFIX + "mlp.experts.gate_up_proj" + suffix] = np.stack(gate_up)
        down = [experts[e, projs[2], tail] for e in range(num_experts)]
        out[PREFIX + "mlp.experts.down_proj" + suffix] = np.stack(down)
    return out


def test_fused_fp8_naming_gives_the_same_params():
    sd = make_state_dict(make_config("deepseek_v3", hidden=128, inter=128, n_shared_experts=1))
    fp8 = {}
    for k, v in sd.items():
        if ".experts." in k or ".shared_experts." in k:
            wq, s = (np.asarray(a) for a in quant.per_block_quant_fp8(jnp.asarray(v)))
            fp8[k], fp8[k + "_scale_inv"] = wq, s
        else:
            fp8[k] = v
    fused = to_fused(fp8, "deepseek_v3")
    assert PREFIX + "mlp.experts.gate_up_proj_scale_inv" in fused
    assert detect_hf_naming(fused, PREFIX).is_fp8
    want, got = hf_moe_params(fp8, PREFIX), hf_moe_params(fused, PREFIX)
    assert got["w1"].dtype == jnp.float8_e4m3fn and got["w1_scale"].shape == (8, 2, 1)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(
            got[name].astype(np.float32), want[name].astype(np.float32), err_msg=name
        )


def qwen2_state_dict(cfg: dict, seed=0) -> dict:
    """A Qwen2-MoE block: Qwen3's routed experts plus a shared expert and its [1, H] gate."""
    sd = make_state_dict(make_config("qwen3_moe"), seed)
    rng = np.random.default_rng(seed + 1)
    h, width = cfg["hidden_size"], cfg["shared_expert_intermediate_size"]
    for p, shape in (("gate_proj", (width, h)), ("up_proj", (width, h)), ("down_proj", (h, width))):
        sd[PREFIX + f"mlp.shared_expert.{p}.weight"] = rng.normal(size=shape).astype(np.float32)
    sd[PREFIX + "mlp.shared_expert_gate.weight"] = rng.normal(size=(1, h)).astype(np.float32)
    return sd


def test_qwen2_moe_arrays_load_with_the_shared_expert_gate():
    cfg = make_config("qwen2_moe", shared_expert_intermediate_size=32)
    sd = qwen2_state_dict(cfg)
    params = hf_moe_params(sd, PREFIX)
    assert detect_hf_naming(sd, PREFIX).shared == "shared_expert"
    np.testing.assert_array_equal(
        params["shared_gate_kernel"], sd[PREFIX + "mlp.shared_expert_gate.weight"].T
    )
    assert params["shared_w1"].shape == (64, 32) and params["shared_w2"].shape == (32, 32)
    layer = moe_from_hf(sd, PREFIX, cfg)
    np.testing.assert_array_equal(
        np.asarray(layer.shared_gate_kernel[...]), params["shared_gate_kernel"]
    )
    del sd[PREFIX + "mlp.shared_expert_gate.weight"]
    with pytest.raises(KeyError, match="shared_expert_gate.weight"):
        hf_moe_params(sd, PREFIX)
