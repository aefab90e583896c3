"""Hugging Face MoE blocks -> `moe_jax.flax_layer.MoE`, three ways.

    moe_from_hf(state_dict, "model.layers.3.", config)   a state dict (checkpoint naming, or a
                                                           transformers 5 model's fused one)
    moe_from_hf(model.state_dict(), prefix, model.config) a model in memory
    moe_from_pretrained(path, 3)                          a checkpoint directory, read lazily

`load_hf_moe(layer, state_dict, prefix)` fills a layer you built. Supported model types:
Mixtral, Qwen3-MoE, DeepSeek-V3 (float or FP8 `weight_scale_inv`), and Qwen2-MoE (its shared
expert and the expert's sigmoid gate: `MoE(has_shared_expert_gate=True)`).
The pieces: `moe_jax.hf_config` (configs), `moe_jax.hf_weights` (namings, stacking),
`moe_jax.hf_checkpoint` (safetensors directories).

HF semantics not reproduced bit for bit: transformers 4's DeepSeek-V3 router fills dropped
groups with 0.0 where vLLM, transformers 5 and moe_jax use -inf (they differ only when a biased
score in a kept group is negative); HF adds 1e-20 to DeepSeek's renormalization sum; and
Mixtral/Qwen compute the router logits in the activation dtype where `MoE` uses float32.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

try:
    from flax import nnx
except ImportError as error:  # flax is an optional extra
    raise ImportError(
        f"moe_jax.hf_loading needs Flax: pip install 'moe_jax[hf]' ({error})"
    ) from error

from moe_jax import quant
from moe_jax.flax_layer import MoE
from moe_jax.hf_checkpoint import check_prefix, open_hf_layer, read_hf_config
from moe_jax.hf_config import (
    SUPPORTED_MODEL_TYPES,
    dense_layer_reason,
    hf_config_dict,
    moe_kwargs_from_hf_config,
)
from moe_jax.hf_weights import (
    HF_NAMINGS,
    HFNaming,
    dequantize_blocks,
    detect_hf_naming,
    hf_moe_params,
    to_numpy,
)

__all__ = [
    "HF_NAMINGS",
    "SUPPORTED_MODEL_TYPES",
    "HFNaming",
    "detect_hf_naming",
    "hf_moe_params",
    "load_hf_moe",
    "moe_from_hf",
    "moe_from_pretrained",
    "moe_kwargs_from_hf_config",
    "to_numpy",
]


def _layer_arrays(layer: MoE, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Converts checkpoint arrays to the layer's format: FP8 <-> float as the layer holds them."""
    out = dict(params)
    for name in ("w1", "w2", "shared_w1", "shared_w2"):
        if name not in out:
            continue
        w, scale = out[name], out.pop(f"{name}_scale", None)
        if layer.is_fp8 and scale is None:
            wq, s = quant.per_block_quant_fp8(jnp.asarray(w), layer.quant_config.block_shape)
            out[name], out[f"{name}_scale"] = np.asarray(wq), np.asarray(s)
        elif layer.is_fp8:
            out[name], out[f"{name}_scale"] = w, scale
        elif scale is not None:  # an FP8 checkpoint into a float layer: dequantize
            var = getattr(layer, name, None)
            dtype = var.get_value().dtype if isinstance(var, nnx.Param) else np.float32
            out[name] = _dequantized(w, scale, dtype, name=name)
    return out


def _dequantized(w: np.ndarray, scale: np.ndarray, dtype: Any, *, name: str) -> np.ndarray:
    """dtype[..., N, K] = float32(w) * scale per 128x128 tile (`hf_weights.dequantize_blocks`),
    after checking the scales' shape."""
    expected = quant.block_scale_shape(w.shape)
    if scale.shape != expected:
        raise ValueError(
            f"{name}: {w.shape=} needs 128x128 block scales of shape {expected} but "
            f"{scale.shape=}; the checkpoint's weight_scale_inv does not match its weight"
        )
    return dequantize_blocks(w, scale, np.empty(w.shape, dtype))


def load_hf_moe(layer: MoE, state_dict: Mapping[str, Any], prefix: str = "") -> MoE:
    """Assigns one HF MoE block's weights to `layer`, in place, and returns it.

    The layer's structure must match the checkpoint (E, H, I, shared experts, correction bias);
    FP8 checkpoints are dequantized into a float layer and float ones quantized into an FP8 layer.
    Float weights are cast to the layer's param dtype. Works on an abstract layer from
    `nnx.eval_shape`, which it fills completely.

    Args:
      layer: the layer to fill.
      state_dict: HF names -> numpy arrays, JAX arrays or torch tensors, in either naming of
        `HF_NAMINGS` (detected from the keys); it may be lazy (see `open_hf_layer`).
      prefix: the decoder layer prefix, e.g. "model.layers.3.".

    Raises:
      ValueError: a param the layer has is absent from the checkpoint or vice versa (checked
        from the keys, before any tensor is read), or a shape differs (the message names the
        param, both shapes and the fix); no MoE block under the prefix.
      KeyError: expert weights are missing.
    """
    return _load(layer, state_dict, prefix, config=None)


def _load(layer: MoE, state_dict: Mapping[str, Any], prefix: str, *, config: str | None) -> MoE:
    """`load_hf_moe`; `config` describes the config the layer was built from (its mismatch with
    the weights is then named as such), None for a layer the caller built."""
    naming = detect_hf_naming(state_dict, prefix)  # keys only: mismatches fail before any read
    layer_params = {name for name, v in vars(layer).items() if isinstance(v, nnx.Param)}
    wanted = {name for name in layer_params if not name.endswith("_scale")}
    if wanted != naming.param_names:
        raise ValueError(_mismatch(naming, prefix, wanted, config))
    arrays = _layer_arrays(layer, hf_moe_params(state_dict, prefix))
    for name in sorted(layer_params):
        # pop: each host array is freed once the layer holds its copy (peak: one extra param)
        var, value = getattr(layer, name), arrays.pop(name)
        current = var.get_value()
        if tuple(current.shape) != value.shape:
            built = f"{config} gives" if config else "the layer holds"
            raise ValueError(
                f"{name}: {built} {tuple(current.shape)} but the weights under {prefix!r} "
                f"give {value.shape}; "
                + (
                    "config and weights do not match: pass the config.json of the checkpoint "
                    "the weights come from"
                    if config
                    else "match hidden_size, intermediate_size, num_experts and num_shared_experts"
                )
            )
        var.set_value(jnp.asarray(value, dtype=current.dtype))
    return layer


def _mismatch(naming: HFNaming, prefix: str, wanted: set[str], config: str | None) -> str:
    """Which params the layer (or its config) and the weights disagree on, as checkpoint keys."""
    shared = naming.shared or "shared_experts"
    keys = {
        "e_score_correction_bias": f"{prefix}{naming.module}gate.e_score_correction_bias",
        "shared_w1": f"{prefix}mlp.{shared}.gate_proj/up_proj.weight",
        "shared_w2": f"{prefix}mlp.{shared}.down_proj.weight",
        "shared_gate_kernel": f"{prefix}mlp.shared_expert_gate.weight",
    }
    found = [f"{prefix}{naming.module}gate.weight", f"{prefix}{naming.module}experts.*"]
    found += [keys[n] for n in sorted(naming.param_names) if n in keys]
    expected = ", ".join(f"{n} ({keys[n]})" for n in sorted(wanted - naming.param_names))
    unexpected = ", ".join(f"{keys[n]} ({n})" for n in sorted(naming.param_names - wanted))
    built = config or "the layer"
    problems = [f"{built} expects {expected}, which the weights lack"] if expected else []
    problems += [f"the weights hold {unexpected}, which {built} lacks"] if unexpected else []
    problems = f"{'; '.join(problems)} (found under {prefix!r}: {found})"
    if config is not None:
        return (
            f"config and weights do not match: {problems}; pass the config.json of the "
            "checkpoint these weights come from (or the prefix of a layer the config describes)"
        )
    return (
        f"{problems}; build the layer to match: with or without "
        "router=RouterConfig(use_correction_bias=True, ...) for e_score_correction_bias, "
        "num_shared_experts > 0 for shared_* and has_shared_expert_gate=True for "
        "shared_gate_kernel"
    )


def moe_from_hf(
    state_dict: Mapping[str, Any], prefix: str, config: Mapping[str, Any] | Any, **layer_kwargs
) -> MoE:
    """An `MoE` holding the HF weights of the MoE block at `prefix`.

    Builds the layer abstractly (`nnx.eval_shape`, no random init) from `config` and fills it
    with `load_hf_moe`.

    Args:
      state_dict: HF names -> arrays or tensors: a checkpoint's (per-expert naming) or a
        transformers 5 model's `state_dict()` (fused naming); detected from the keys.
      prefix: the decoder layer prefix, e.g. "model.layers.3.".
      config: the model's config.json dict or PretrainedConfig (`moe_kwargs_from_hf_config`).
      **layer_kwargs: `MoE` constructor arguments that override or add to the config's
        (dtype, param_dtype, quant_config, experts, chunk_size).

    Raises:
      As `moe_kwargs_from_hf_config` and `load_hf_moe`.

    Example:
      >>> import numpy as np
      >>> rng = np.random.default_rng(0)
      >>> sd = {"mlp.gate.weight": rng.normal(size=(4, 8))}
      >>> for e in range(4):
      ...     for p, shape in (("gate_proj", (6, 8)), ("up_proj", (6, 8)), ("down_proj", (8, 6))):
      ...         sd[f"mlp.experts.{e}.{p}.weight"] = rng.normal(size=shape)
      >>> cfg = dict(model_type="qwen3_moe", hidden_size=8, moe_intermediate_size=6,
      ...            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
      >>> layer = moe_from_hf(sd, "", cfg)
      >>> layer.w1.shape, layer(np.ones((3, 8), np.float32)).shape
      ((4, 12, 8), (3, 8))
    """
    kwargs = moe_kwargs_from_hf_config(config) | layer_kwargs
    layer = nnx.eval_shape(lambda: MoE(**kwargs, rngs=nnx.Rngs(0)))
    sizes = ("hidden_size", "intermediate_size", "num_experts", "num_shared_experts")
    described = ", ".join(f"{k}={kwargs[k]}" for k in sizes if k in kwargs)
    model_type = hf_config_dict(config).get("model_type")
    if model_type != "mixtral" and detect_hf_naming(state_dict, prefix).module != "mlp.":
        raise ValueError(
            f"config and weights do not match: the weights under {prefix!r} are a Mixtral "
            f"block ({prefix}block_sparse_moe.*) but the config has {model_type=}; pass the "
            "config.json of the checkpoint these weights come from"
        )
    with_kwargs = f" with layer_kwargs {sorted(layer_kwargs)}" if layer_kwargs else ""
    _load(layer, state_dict, prefix, config=f"the {model_type} config ({described}){with_kwargs}")
    leftover = [
        name
        for name, v in vars(layer).items()
        if isinstance(v, nnx.Variable) and isinstance(v.get_value(), jax.ShapeDtypeStruct)
    ]
    if leftover:  # load_hf_moe checks the param sets match, so this means a new variable kind
        raise ValueError(f"variables {leftover} were not loaded from the checkpoint")
    return layer


def moe_from_pretrained(
    path: str | Path, layer_index: int, *, layers_prefix: str = "model.layers.", **layer_kwargs
) -> MoE:
    """An `MoE` holding decoder layer `layer_index`'s MoE block of a checkpoint directory.

    Reads path/config.json, then, lazily, only the tensors of that layer's MoE block from
    model.safetensors or the shards of model.safetensors.index.json (`moe_jax.hf_checkpoint`);
    shards that hold none of them are never opened. Peak host memory: the block's weights as
    stored, plus their conversion to the layer's dtype (all of it for an FP8 checkpoint into a
    float layer, which is dequantized one expert at a time), plus one param as the layer holds
    it. Params are float32 unless `param_dtype=` says otherwise (`jnp.bfloat16` halves that).
    DeepSeek-V3's FP8 weights and their `weight_scale_inv` block scales are read as such: they
    stay FP8 in a layer built with `quant_config=quant.Fp8BlockQuant()` and are dequantized
    into a float layer otherwise.
    Needs safetensors and torch (`pip install 'moe_jax[hf]'`).

    Args:
      path: the checkpoint directory (config.json and safetensors files), e.g. a
        `huggingface_hub.snapshot_download` result or a `save_pretrained` output, or the path
        of its config.json.
      layer_index: the decoder layer, from 0.
      layers_prefix: the name of the decoder layers in the checkpoint; tensors are read from
        f"{layers_prefix}{layer_index}.".
      **layer_kwargs: `MoE` constructor arguments, as for `moe_from_hf`.

    Raises:
      FileNotFoundError: no config.json, or no safetensors checkpoint, in `path`.
      ValueError: the layer is not in the checkpoint, or is a dense MLP (the message says
        which config field makes it dense), or as `moe_from_hf`.
      NotImplementedError: as `moe_kwargs_from_hf_config` and `load_hf_moe`.
    """
    if isinstance(layer_index, bool) or not isinstance(layer_index, numbers.Integral):
        example = int(layer_index) if str(layer_index).isdigit() else 3
        raise TypeError(
            f"layer_index={layer_index!r} must be an int: the decoder layer, counted from 0 "
            f"(e.g. moe_from_pretrained(path, {example}))"
        )
    if layer_index < 0:
        raise ValueError(f"layer_index={layer_index} must be >= 0 (decoder layers count from 0)")
    check_prefix(layers_prefix, name="layers_prefix")
    config = read_hf_config(path)
    moe_kwargs_from_hf_config(config)  # unsupported model types fail before any tensor is read
    num_layers = config.get("num_hidden_layers")
    if num_layers is not None and layer_index < num_layers:
        if (why := dense_layer_reason(config, layer_index)) is not None:
            moe_layers = [i for i in range(num_layers) if dense_layer_reason(config, i) is None]
            raise ValueError(
                f"layer_index={layer_index}: that layer of {path} is a dense MLP, not an MoE "
                f"block ({why}); pick an MoE layer: {_listed(moe_layers)}"
            )
    prefix = f"{layers_prefix}{layer_index}."
    try:
        tensors = open_hf_layer(path, prefix)
    except ValueError as e:
        raise ValueError(f"layer_index={layer_index}: {e}") from e
    with tensors:
        return moe_from_hf(tensors, prefix, config, **layer_kwargs)


def _listed(indices: list[int]) -> str:
    """'3..60' for consecutive indices, else the first few: '1, 3, 5, ... (30 in all)'."""
    if not indices:
        return "none (the config makes every layer dense)"
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}..{indices[-1]}" if len(indices) > 1 else str(indices[0])
    more = f", ... ({len(indices)} in all)" if len(indices) > 6 else ""
    return ", ".join(map(str, indices[:6])) + more
