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
from moe_jax.hf_checkpoint import open_hf_layer, read_hf_config
from moe_jax.hf_config import SUPPORTED_MODEL_TYPES, dense_layer_reason, moe_kwargs_from_hf_config
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
      ValueError: a param the layer has is absent from the checkpoint or vice versa, or a shape
        differs (the message names the param, both shapes and the fix); no MoE block under
        the prefix.
      KeyError: expert weights are missing.
    """
    arrays = _layer_arrays(layer, hf_moe_params(state_dict, prefix))
    layer_params = {name for name, v in vars(layer).items() if isinstance(v, nnx.Param)}
    if extra := sorted(set(arrays) - layer_params):
        raise ValueError(
            f"the checkpoint under {prefix!r} has {extra} but the layer does not: build it with "
            "router=RouterConfig(use_correction_bias=True, ...) for e_score_correction_bias and "
            "num_shared_experts > 0 for shared_* (and has_shared_expert_gate=True for "
            "shared_gate_kernel)"
        )
    if absent := sorted(layer_params - set(arrays)):
        raise ValueError(
            f"the layer has params {absent} that the checkpoint under {prefix!r} "
            "lacks: build the layer without them"
        )
    for name in sorted(layer_params):
        # pop: each host array is freed once the layer holds its copy (peak: one extra param)
        var, value = getattr(layer, name), arrays.pop(name)
        current = var.get_value()
        if tuple(current.shape) != value.shape:
            raise ValueError(
                f"{name}: the layer holds {tuple(current.shape)} but the checkpoint "
                f"under {prefix!r} gives {value.shape}; match hidden_size, "
                "intermediate_size, num_experts and num_shared_experts"
            )
        var.set_value(jnp.asarray(value, dtype=current.dtype))
    return layer


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
    load_hf_moe(layer, state_dict, prefix)
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
        `huggingface_hub.snapshot_download` result or a `save_pretrained` output.
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
    if layer_index < 0:
        raise ValueError(f"layer_index={layer_index} must be >= 0 (decoder layers count from 0)")
    if not layers_prefix.endswith("."):
        raise ValueError(
            f"layers_prefix={layers_prefix!r} must end with '.' (e.g. 'model.layers.'): the "
            "layer's keys are layers_prefix + index + '.'"
        )
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
