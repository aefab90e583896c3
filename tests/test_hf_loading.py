"""moe_jax.hf_loading on tiny HF-style state dicts built here: how the weights are stacked, torch
and FP8 checkpoints, and what is refused. The loaded layer against transformers' own MoE blocks is
tests/test_hf_transformers.py's (FP8 checkpoints: tests/test_hf_checkpoint.py's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import oracles
import pytest
from flax import nnx

from moe_jax import quant
from moe_jax.flax_layer import MoE
from moe_jax.hf_loading import (
    detect_hf_naming,
    hf_moe_params,
    load_hf_moe,
    moe_from_hf,
    moe_kwargs_from_hf_config,
)

PREFIX = "model.layers.3."
PROJ = {
    "mixtral": (
        "block_sparse_moe.gate.weight",
        "block_sparse_moe.experts.{e}.{p}.weight",
        ("w1", "w3", "w2"),
    ),
    "qwen3_moe": (
        "mlp.gate.weight",
        "mlp.experts.{e}.{p}.weight",
        ("gate_proj", "up_proj", "down_proj"),
    ),
}
PROJ["deepseek_v3"] = PROJ["qwen3_moe"]


def make_config(model_type, *, hidden=32, inter=16, experts=8, topk=2, **extra) -> dict:
    if model_type == "mixtral":
        cfg = dict(
            hidden_size=hidden,
            intermediate_size=inter,
            num_local_experts=experts,
            num_experts_per_tok=topk,
        )
    elif model_type in ("qwen3_moe", "qwen2_moe"):
        cfg = dict(
            hidden_size=hidden,
            moe_intermediate_size=inter,
            num_experts=experts,
            num_experts_per_tok=topk,
            norm_topk_prob=False,
        )
    else:
        cfg = dict(
            hidden_size=hidden,
            moe_intermediate_size=inter,
            n_routed_experts=experts,
            num_experts_per_tok=topk,
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
        )
    return dict(model_type=model_type, **cfg) | extra


def make_state_dict(cfg: dict, seed=0) -> dict[str, np.ndarray]:
    """Random HF weights ([out, in] linears) plus an unrelated attention key."""
    rng = np.random.default_rng(seed)
    kw = moe_kwargs_from_hf_config(cfg)
    h, i, e = kw["hidden_size"], kw["intermediate_size"], kw["num_experts"]
    router_key, expert_fmt, projs = PROJ[cfg["model_type"]]
    sd = {
        PREFIX + "self_attn.q_proj.weight": rng.normal(size=(h, h)).astype(np.float32),
        PREFIX + router_key: rng.normal(size=(e, h)).astype(np.float32),
    }
    for ex in range(e):
        for p, shape in zip(projs, ((i, h), (i, h), (h, i)), strict=True):
            sd[PREFIX + expert_fmt.format(e=ex, p=p)] = (
                rng.normal(size=shape) / np.sqrt(shape[1])
            ).astype(np.float32)
    if cfg["model_type"] == "deepseek_v3":
        sd[PREFIX + "mlp.gate.e_score_correction_bias"] = rng.uniform(-0.1, 0.1, e).astype(
            np.float32
        )
        width = cfg["n_shared_experts"] * i
        for p, shape in zip(projs, ((width, h), (width, h), (h, width)), strict=True):
            sd[PREFIX + f"mlp.shared_experts.{p}.weight"] = (
                rng.normal(size=shape) / np.sqrt(shape[1])
            ).astype(np.float32)
    return sd


# --- tests -------------------------------------------------------------------------------------


CASES = {
    "mixtral": make_config("mixtral"),
    "qwen3_moe": make_config("qwen3_moe"),
    "qwen3_moe_norm": make_config("qwen3_moe", norm_topk_prob=True),
    "deepseek_v3": make_config("deepseek_v3"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layer_stacks_the_hf_weights(case):
    """Expert 5's w1 is [gate; up], w2 is down, the router is gate.T; DeepSeek's bias and
    shared experts (2 of I=16) are loaded."""
    cfg = CASES[case]
    sd = make_state_dict(cfg)
    layer = moe_from_hf(sd, PREFIX, cfg)
    router_key, expert_fmt, (g, u, d) = PROJ[cfg["model_type"]]
    key = PREFIX + expert_fmt
    np.testing.assert_array_equal(
        layer.w1[...][5], np.concatenate([sd[key.format(e=5, p=g)], sd[key.format(e=5, p=u)]])
    )
    np.testing.assert_array_equal(layer.w2[...][5], sd[key.format(e=5, p=d)])
    np.testing.assert_array_equal(layer.router_kernel[...], sd[PREFIX + router_key].T)
    if case == "deepseek_v3":
        assert layer.shared_w1.shape == (2 * 2 * 16, 32)
        np.testing.assert_array_equal(
            layer.e_score_correction_bias[...], sd[PREFIX + "mlp.gate.e_score_correction_bias"]
        )


def test_torch_bf16_tensors_load_like_numpy():
    torch = pytest.importorskip("torch", reason="torch bf16 tensors need torch (extra 'torch')")
    cfg = CASES["qwen3_moe_norm"]
    sd = make_state_dict(cfg)
    as_torch = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in sd.items()}
    rounded = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in sd.items()}
    got = hf_moe_params(as_torch, PREFIX)
    want = hf_moe_params(rounded, PREFIX)
    assert got["w1"].dtype == ml_dtypes.bfloat16
    for name in want:
        np.testing.assert_array_equal(got[name].astype(np.float32), want[name])
    x = np.random.default_rng(1).normal(size=(6, 32)).astype(np.float32)
    layer = moe_from_hf(as_torch, PREFIX, cfg)
    np.testing.assert_allclose(layer(x), moe_from_hf(rounded, PREFIX, cfg)(x), rtol=1e-6)


def _fp8_checkpoint(sd: dict, *, as_torch: bool) -> dict:
    """DeepSeek-V3 FP8 layout: each expert/shared linear as e4m3 + `weight_scale_inv` blocks
    (ragged edge tiles where I is not a multiple of 128, which `quant.per_block_quant_fp8`
    refuses: the oracle makes them)."""
    out = {}
    for k, v in sd.items():
        if ".experts." in k or ".shared_experts." in k:
            wq, s = oracles.per_block_quant_fp8(v)
            out[k], out[k + "_scale_inv"] = wq, s
        else:
            out[k] = v
    if as_torch:
        torch = pytest.importorskip("torch", reason="torch FP8 tensors need torch (extra 'torch')")
        out = {
            k: torch.from_numpy(v.view(np.uint8).copy()).view(torch.float8_e4m3fn)
            if v.dtype == ml_dtypes.float8_e4m3fn
            else torch.from_numpy(v.copy())
            for k, v in out.items()
        }
    return out


def _dequantized(fp8_sd: dict) -> dict:
    """The float64 weights an FP8 checkpoint (numpy) stands for: w * scale per 128x128 tile."""
    return {
        k: oracles.dequant_per_block(v, fp8_sd[k + "_scale_inv"])
        if k + "_scale_inv" in fp8_sd
        else v
        for k, v in fp8_sd.items()
        if not k.endswith("_scale_inv")
    }


@pytest.mark.parametrize("as_torch", [False, True])
def test_fp8_checkpoint(as_torch):
    cfg = make_config("deepseek_v3", hidden=128, inter=128, n_shared_experts=1)
    sd = make_state_dict(cfg)
    fp8_sd = _fp8_checkpoint(sd, as_torch=as_torch)
    # FP8 checkpoint into an FP8 layer == float checkpoint quantized on load.
    direct = moe_from_hf(fp8_sd, PREFIX, cfg, quant_config=quant.Fp8BlockQuant())
    quantized = moe_from_hf(sd, PREFIX, cfg, quant_config=quant.Fp8BlockQuant())
    # Scales are compared to 1 ulp: they come from differently shaped XLA compilations (per
    # expert here, stacked on load there).
    for name in ("w1", "w2", "shared_w1", "shared_w2"):
        assert getattr(direct, name).dtype == jnp.float8_e4m3fn
        np.testing.assert_array_equal(
            np.asarray(getattr(direct, name)[...], np.float32),
            np.asarray(getattr(quantized, name)[...], np.float32),
        )
        np.testing.assert_allclose(
            getattr(direct, name + "_scale")[...],
            getattr(quantized, name + "_scale")[...],
            rtol=2e-7,
        )
    # FP8 checkpoint into a float layer: dequantized weights.
    dense = moe_from_hf(fp8_sd, PREFIX, cfg)
    assert dense.w1.dtype == jnp.float32 and dense.w1_scale is None
    np.testing.assert_array_equal(
        dense.w2[...], quant.dequant_per_block(direct.w2[...], direct.w2_scale[...])
    )
    # The float layer computes with exactly the checkpoint's weights: w * scale per 128x128 tile.
    # (The FP8 layer's own forward is fused_moe's, tested with the layer; on a CPU it is slow.)
    dequantized = _dequantized(_fp8_checkpoint(sd, as_torch=False))
    x = np.random.default_rng(1).normal(size=(8, 128)).astype(np.float32)
    want = moe_from_hf(dequantized, PREFIX, cfg)(x)
    np.testing.assert_allclose(dense(x), want, rtol=1e-5, atol=1e-6)


def test_ue8m0_scales_held_as_torch_float8_e8m0fnu_load_like_float32_ones():
    """UE8M0 checkpoints (DeepSeek-V3.1's scale_fmt) store power-of-two scales; transformers 5
    may hold them as torch.float8_e8m0fnu, which `to_numpy` could not convert."""
    torch = pytest.importorskip("torch", reason="torch FP8 tensors need torch (extra 'torch')")
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip(f"torch {torch.__version__} has no float8_e8m0fnu")
    cfg = make_config("deepseek_v3", hidden=128, inter=128, n_shared_experts=1)
    fp8_sd = _fp8_checkpoint(make_state_dict(cfg), as_torch=False)
    for k in [k for k in fp8_sd if k.endswith("_scale_inv")]:
        fp8_sd[k] = np.exp2(np.round(np.log2(fp8_sd[k]))).astype(np.float32)
    as_torch = {
        k: torch.from_numpy(v).to(torch.float8_e8m0fnu)
        if k.endswith("_scale_inv")
        else torch.from_numpy(v.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        if v.dtype == ml_dtypes.float8_e4m3fn
        else torch.from_numpy(v.copy())
        for k, v in fp8_sd.items()
    }
    got, want = hf_moe_params(as_torch, PREFIX), hf_moe_params(fp8_sd, PREFIX)
    for name in want:
        np.testing.assert_array_equal(
            np.asarray(got[name], np.float32), np.asarray(want[name], np.float32)
        )


@pytest.mark.parametrize("inter", [200, 192])
def test_fp8_checkpoint_with_i_not_a_multiple_of_128_dequantizes_each_half(inter):
    """Gate and up are block-scaled separately; where I is not a multiple of 128 their joined
    scales do not tile the joined [2I, H] weight: at I=200 the up half used to take the wrong
    scales silently (0.36 off), at I=192 a valid checkpoint was refused."""
    cfg = make_config("deepseek_v3", hidden=128, inter=inter, n_shared_experts=1)
    fp8_sd = _fp8_checkpoint(make_state_dict(cfg), as_torch=False)
    dequantized = _dequantized(fp8_sd)
    dense = moe_from_hf(fp8_sd, PREFIX, cfg)
    up = dequantized[PREFIX + "mlp.experts.1.up_proj.weight"]
    # float32(code) * float32(scale), one rounding from the float64 oracle's product
    np.testing.assert_allclose(np.asarray(dense.w1[...][1, inter:]), up, rtol=2**-24, atol=0)
    x = np.random.default_rng(2).normal(size=(8, 128)).astype(np.float32)
    want = moe_from_hf(dequantized, PREFIX, cfg)(x)
    np.testing.assert_allclose(dense(x), want, rtol=1e-5, atol=1e-6)


def test_experts_of_other_shapes_are_refused_naming_the_key():
    """An expert's tensor shorter than expert 0's used to leave garbage rows (np.empty), one with
    other columns was broadcast."""
    cfg = make_config("qwen3_moe", hidden=64, inter=32)
    for key, value in [
        (PREFIX + "mlp.experts.2.up_proj.weight", lambda a: a[:2]),
        (PREFIX + "mlp.experts.3.gate_proj.weight", lambda a: np.ones((a.shape[0], 1), a.dtype)),
    ]:
        sd = make_state_dict(cfg)
        sd[key] = value(sd[key])
        with pytest.raises(ValueError, match="all experts need the same shapes"):
            hf_moe_params(sd, PREFIX)


def test_fp8_scales_that_do_not_fit_the_weights_are_refused():
    cfg = make_config("deepseek_v3", hidden=128, inter=128, n_shared_experts=1)
    fp8_sd = _fp8_checkpoint(make_state_dict(cfg), as_torch=False)
    for k in fp8_sd:
        if ".experts." in k and k.endswith("down_proj.weight_scale_inv"):
            fp8_sd[k] = np.ones((2, 1), np.float32)  # [1, 1] fits a 128x128 weight
    with pytest.raises(ValueError, match=r"w2: .*scales of shape \(8, 1, 1\).*weight_scale_inv"):
        moe_from_hf(fp8_sd, PREFIX, cfg)


def test_load_into_existing_layer_casts_and_returns_it():
    cfg = CASES["mixtral"]
    sd = make_state_dict(cfg)
    layer = MoE(32, 16, num_experts=8, topk=2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert load_hf_moe(layer, sd, PREFIX) is layer
    assert layer.w1.dtype == jnp.bfloat16
    key = PREFIX + "block_sparse_moe.experts.7.w2.weight"
    np.testing.assert_array_equal(
        np.asarray(layer.w2[...][7], np.float32),
        sd[key].astype(ml_dtypes.bfloat16).astype(np.float32),
    )
    out = nnx.jit(lambda m, x: m(x))(layer, jnp.ones((3, 32), jnp.bfloat16))
    assert out.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))


def test_detect_naming():
    expected = {
        "mixtral": ("block_sparse_moe.", ("w1", "w3", "w2"), None, False),
        "qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj"), None, False),
        "deepseek_v3": ("mlp.", ("gate_proj", "up_proj", "down_proj"), "shared_experts", True),
    }
    for model_type, (module, projections, shared, has_bias) in expected.items():
        naming = detect_hf_naming(make_state_dict(make_config(model_type)), PREFIX)
        assert (naming.module, naming.projections, naming.shared) == (module, projections, shared)
        assert naming.has_correction_bias == has_bias and not naming.is_fused
        assert not naming.is_fp8


def test_missing_keys_are_listed():
    sd = make_state_dict(CASES["deepseek_v3"])
    del sd[PREFIX + "mlp.experts.3.up_proj.weight"]
    del sd[PREFIX + "mlp.shared_experts.down_proj.weight"]
    with pytest.raises(KeyError, match="missing 2 keys") as info:
        hf_moe_params(sd, PREFIX)
    assert "model.layers.3.mlp.experts.3.up_proj.weight" in str(info.value)
    assert "model.layers.3.mlp.shared_experts.down_proj.weight" in str(info.value)


def test_wrong_prefix_dense_layer_and_unsupported_configs():
    sd = make_state_dict(CASES["mixtral"])
    with pytest.raises(ValueError, match="no MoE router under prefix 'model.layers.4.'"):
        hf_moe_params(sd, "model.layers.4.")
    dense = {PREFIX + f"mlp.{p}.weight": np.zeros((4, 4)) for p in ("gate_proj", "up_proj")}
    with pytest.raises(ValueError, match="dense MLP"):
        hf_moe_params(dense, PREFIX)
    with pytest.raises(ValueError, match="model_type='llama'.*mixtral, qwen3_moe, qwen2_moe"):
        moe_kwargs_from_hf_config({"model_type": "llama"})
    with pytest.raises(NotImplementedError, match="topk_method='greedy'.*'noaux_tc'"):
        moe_kwargs_from_hf_config(make_config("deepseek_v3", topk_method="greedy"))
    with pytest.raises(NotImplementedError, match="scoring_func='softmax'"):
        moe_kwargs_from_hf_config(make_config("deepseek_v3", scoring_func="softmax"))
    with pytest.raises(NotImplementedError, match="hidden_act='relu'.*silu"):
        moe_kwargs_from_hf_config(make_config("mixtral", hidden_act="relu"))
    awq = {"quant_method": "awq", "bits": 4}
    with pytest.raises(NotImplementedError, match="quant_method='awq'.*'fp8'"):
        moe_kwargs_from_hf_config(make_config("qwen3_moe", quantization_config=awq))
    fp8_64 = {"quant_method": "fp8", "weight_block_size": [64, 64]}
    with pytest.raises(NotImplementedError, match=r"weight_block_size=\[64, 64\]"):
        moe_kwargs_from_hf_config(make_config("deepseek_v3", quantization_config=fp8_64))
    with pytest.raises(ValueError, match="lacks 'num_experts_per_tok'"):
        moe_kwargs_from_hf_config({"model_type": "qwen3_moe", "hidden_size": 8})
    with pytest.raises(TypeError, match="config is a list"):
        moe_kwargs_from_hf_config([("model_type", "mixtral")])


def _abstract(hidden, inter, **kwargs) -> MoE:
    """An `MoE` without initial values (no initializer runs): load_hf_moe fills it."""
    return nnx.eval_shape(
        lambda: MoE(hidden, inter, num_experts=8, topk=2, **kwargs, rngs=nnx.Rngs(0))
    )


def test_layer_checkpoint_mismatch_errors():
    ds = make_state_dict(CASES["deepseek_v3"])
    plain = _abstract(32, 16)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        load_hf_moe(plain, ds, PREFIX)
    shared = _abstract(32, 16, num_shared_experts=1)
    with pytest.raises(ValueError, match=r"the layer expects shared_w1 .*which the weights lack"):
        load_hf_moe(shared, make_state_dict(CASES["qwen3_moe"]), PREFIX)
    wide = _abstract(32, 24)
    with pytest.raises(ValueError, match=r"w1: the layer holds \(8, 48, 32\).*\(8, 32, 32\)"):
        load_hf_moe(wide, make_state_dict(CASES["mixtral"]), PREFIX)
    bad = make_state_dict(CASES["mixtral"])
    bad[PREFIX + "block_sparse_moe.gate.weight"] = np.zeros((8, 32, 1), np.float32)
    with pytest.raises(ValueError, match=r"\[E, H\]"):
        hf_moe_params(bad, PREFIX)


def test_abstract_build_does_no_random_init():
    cfg = CASES["mixtral"]
    sd = make_state_dict(cfg)
    layer = moe_from_hf(sd, PREFIX, cfg)
    leaves = jax.tree.leaves(nnx.state(layer))
    assert leaves and all(isinstance(v, jax.Array) for v in leaves)


# --- inputs a newcomer gets wrong ----------------------------------------------------------------


class _CountingDict(dict):
    """A state dict that counts tensor reads (key lookups by `[]`), as a lazy checkpoint would."""

    reads = 0

    def __getitem__(self, key):
        self.reads += 1
        return super().__getitem__(key)


@pytest.mark.parametrize(
    "weights,config,match",
    [
        pytest.param(
            "qwen3_moe",
            "deepseek_v3",
            r"config and weights do not match: the deepseek_v3 config \(hidden_size=32.*\) "
            r"expects e_score_correction_bias \(model\.layers\.3\.mlp\.gate\."
            r"e_score_correction_bias\), shared_w1 .*which the weights lack \(found under "
            r"'model\.layers\.3\.': \['model\.layers\.3\.mlp\.gate\.weight', "
            r"'model\.layers\.3\.mlp\.experts\.\*'\]\); pass the config\.json",
            id="qwen_weights_deepseek_config",
        ),
        pytest.param(
            "deepseek_v3",
            "qwen3_moe",
            r"config and weights do not match: the weights hold model\.layers\.3\.mlp\.gate\."
            r"e_score_correction_bias .*which the qwen3_moe config .* lacks",
            id="deepseek_weights_qwen_config",
        ),
        pytest.param(
            "mixtral",
            "qwen3_moe",
            r"config and weights do not match: .* Mixtral block .*model_type='qwen3_moe'",
            id="mixtral_weights_qwen_config",
        ),
    ],
)
def test_config_and_weights_that_do_not_match_are_named_so(weights, config, match):
    """Built from the config, the layer is not the user's: the error says the config and the
    weights disagree (it used to say "build the layer without them"), from the keys alone."""
    sd = _CountingDict(make_state_dict(CASES[weights]))
    with pytest.raises(ValueError, match=match):
        moe_from_hf(sd, PREFIX, make_config(config))
    assert sd.reads == 0


def test_config_sizes_that_do_not_match_the_weights_are_named_so():
    with pytest.raises(
        ValueError,
        match=r"w1: the qwen3_moe config \(hidden_size=32, intermediate_size=8, num_experts=8\) "
        r"gives \(8, 16, 32\) but the weights under 'model\.layers\.3\.' give \(8, 32, 32\);"
        r" config and weights do not match",
    ):
        moe_from_hf(make_state_dict(CASES["qwen3_moe"]), PREFIX, make_config("qwen3_moe", inter=8))


@pytest.mark.parametrize(
    "load",
    [
        pytest.param(
            lambda sd: moe_from_hf(sd, "model.layers.3", CASES["qwen3_moe"]), id="moe_from_hf"
        ),
        pytest.param(lambda sd: hf_moe_params(sd, "model.layers.3"), id="hf_moe_params"),
        pytest.param(lambda sd: detect_hf_naming(sd, "model.layers.3"), id="detect"),
    ],
)
def test_a_prefix_without_its_trailing_dot_is_refused_suggesting_it(load):
    with pytest.raises(
        ValueError, match=r"prefix='model\.layers\.3' must end with '\.'.*pass 'model\.layers\.3\.'"
    ):
        load(make_state_dict(CASES["qwen3_moe"]))
    with pytest.raises(TypeError, match=r"prefix=3 must be a str"):
        hf_moe_params({}, 3)
