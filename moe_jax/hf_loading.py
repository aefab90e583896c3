"""Hugging Face MoE checkpoints -> `moe_jax.flax_layer.MoE` params.

Per-expert HF linears (weight [out, in], already the NT layout vLLM uses) are stacked into
w1 = concat(gate, up) [E, 2I, H] and w2 = down [E, H, I]; the router `gate.weight` [E, H] becomes
`router_kernel` [H, E]. Namings, under a layer prefix such as "model.layers.3.":

    mixtral      block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.w1/w3/w2.weight
    qwen3_moe    mlp.gate.weight, mlp.experts.{e}.gate_proj/up_proj/down_proj.weight
    deepseek_v3  as qwen3_moe, plus mlp.gate.e_score_correction_bias and
                 mlp.shared_experts.gate_proj/up_proj/down_proj.weight

FP8 checkpoints (DeepSeek-V3's `*.weight_scale_inv` 128x128 block scales, the vLLM layout) are read
as such. Values may be numpy arrays, JAX arrays or torch tensors (torch is imported only when a
tensor is converted). Routing hyperparameters live in config.json, not in the weights:
`moe_kwargs_from_hf_config` turns one into `MoE` constructor arguments.

HF semantics not reproduced bit for bit: HF's DeepSeek-V3 router fills dropped groups with 0.0
where vLLM (and moe_jax) use -inf (they differ only when a biased score in a kept group is
negative), adds 1e-20 to the renormalization sum, and Mixtral/Qwen3 compute the router logits in
the activation dtype where `MoE` uses float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from moe_jax import quant
from moe_jax.flax_layer import MoE, RouterConfig

# naming -> (router key, expert key format, (gate, up, down) projection names)
_NAMINGS = {
    "mixtral": (
        "block_sparse_moe.gate.weight",
        "block_sparse_moe.experts.{e}.{proj}.weight",
        ("w1", "w3", "w2"),
    ),
    "qwen3_moe": (
        "mlp.gate.weight",
        "mlp.experts.{e}.{proj}.weight",
        ("gate_proj", "up_proj", "down_proj"),
    ),
    "deepseek_v3": (
        "mlp.gate.weight",
        "mlp.experts.{e}.{proj}.weight",
        ("gate_proj", "up_proj", "down_proj"),
    ),
}
HF_NAMINGS = tuple(_NAMINGS)
_BIAS_KEY = "mlp.gate.e_score_correction_bias"
_SHARED_KEY = "mlp.shared_experts.{proj}.weight"
_SCALE_SUFFIX = "_scale_inv"  # DeepSeek-V3 FP8: "<name>.weight_scale_inv" next to "<name>.weight"
_MAX_LISTED = 12


def to_numpy(value: Any) -> np.ndarray:
    """A numpy array from a numpy/JAX array or a torch tensor (bf16 and fp8 via ml_dtypes)."""
    if type(value).__module__.startswith("torch"):
        import torch

        t = value.detach().cpu()
        views = {
            torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
            torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
        }
        if t.dtype in views:
            raw, dtype = views[t.dtype]
            return t.contiguous().view(raw).numpy().view(dtype)
        return t.numpy()
    return np.asarray(value)


def detect_hf_naming(state_dict: Mapping[str, Any], prefix: str = "") -> str:
    """Which HF MoE naming the keys under `prefix` follow: one of `HF_NAMINGS`."""
    if prefix + "block_sparse_moe.gate.weight" in state_dict:
        return "mixtral"
    if prefix + "mlp.shared_expert.gate_proj.weight" in state_dict:
        raise NotImplementedError(
            f"{prefix}mlp.shared_expert.* is Qwen2-MoE's sigmoid-gated shared expert, which MoE "
            "does not model; supported namings: " + ", ".join(HF_NAMINGS)
        )
    if (
        prefix + _BIAS_KEY in state_dict
        or prefix + _SHARED_KEY.format(proj="gate_proj") in state_dict
    ):
        return "deepseek_v3"
    if prefix + "mlp.gate.weight" in state_dict:
        return "qwen3_moe"
    near = sorted(k for k in state_dict if k.startswith(prefix))[:_MAX_LISTED]
    raise ValueError(
        f"no MoE router under prefix {prefix!r}: expected {prefix}block_sparse_moe.gate.weight "
        f"(Mixtral) or {prefix}mlp.gate.weight (Qwen3-MoE, DeepSeek-V3). Keys under the prefix: "
        f"{near or 'none'} (check the prefix, e.g. 'model.layers.3.')"
    )


def _raise_missing(missing: list[str], prefix: str, naming: str) -> None:
    if missing:
        listed = ", ".join(missing[:_MAX_LISTED])
        more = f" and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
        raise KeyError(
            f"{naming} MoE weights under {prefix!r} are incomplete: missing "
            f"{len(missing)} keys: {listed}{more}"
        )


def _stack_projections(state_dict, keys: list[list[str]]) -> tuple[np.ndarray, np.ndarray | None]:
    """keys[e] = [gate, up, down] weight keys -> (w1 [E, 2I, H], w2 [E, H, I]) and scales."""

    def scale_key(k):
        return k + _SCALE_SUFFIX

    has_scales = scale_key(keys[0][0]) in state_dict
    w1 = np.stack(
        [np.concatenate([to_numpy(state_dict[g]), to_numpy(state_dict[u])]) for g, u, _ in keys]
    )
    w2 = np.stack([to_numpy(state_dict[d]) for _, _, d in keys])
    if not has_scales:
        return (w1, w2), None
    s1 = np.stack(
        [
            np.concatenate([to_numpy(state_dict[scale_key(g)]), to_numpy(state_dict[scale_key(u)])])
            for g, u, _ in keys
        ]
    )
    s2 = np.stack([to_numpy(state_dict[scale_key(d)]) for _, _, d in keys])
    return (w1, w2), (s1.astype(np.float32), s2.astype(np.float32))


def hf_moe_params(state_dict: Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    """Stacks one HF MoE block's weights into `MoE` param arrays.

    Args:
      state_dict: HF names -> numpy arrays or torch tensors.
      prefix: the decoder layer prefix, e.g. "model.layers.3." (keys are prefix + name).

    Returns:
      numpy arrays named as `MoE` params: router_kernel [H, E], w1 [E, 2I, H], w2 [E, H, I];
      e_score_correction_bias [E] and shared_w1 [2nI, H], shared_w2 [H, nI] when the checkpoint
      has them; with FP8 checkpoints w1/w2 are float8_e4m3fn and `*_scale` arrays come too.

    Raises:
      ValueError: no known router key under the prefix.
      KeyError: expert or shared-expert weights are missing (all missing keys are counted).
    """
    naming = detect_hf_naming(state_dict, prefix)
    router_key, expert_fmt, projs = _NAMINGS[naming]
    gate = to_numpy(state_dict[prefix + router_key])
    if gate.ndim != 2:
        raise ValueError(f"{prefix + router_key} has shape {gate.shape} but [E, H] is needed")
    num_experts = gate.shape[0]
    keys = [[prefix + expert_fmt.format(e=e, proj=p) for p in projs] for e in range(num_experts)]
    shared = [prefix + _SHARED_KEY.format(proj=p) for p in projs]
    has_shared = naming == "deepseek_v3" and any(k in state_dict for k in shared)
    wanted = [k for row in keys for k in row] + (shared if has_shared else [])
    fp8 = keys[0][0] + _SCALE_SUFFIX in state_dict
    if fp8:
        wanted += [k + _SCALE_SUFFIX for k in wanted]
    _raise_missing([k for k in wanted if k not in state_dict], prefix, naming)

    params = {"router_kernel": np.ascontiguousarray(gate.T)}
    (params["w1"], params["w2"]), scales = _stack_projections(state_dict, keys)
    if scales is not None:
        params["w1_scale"], params["w2_scale"] = scales
    if prefix + _BIAS_KEY in state_dict:
        params["e_score_correction_bias"] = to_numpy(state_dict[prefix + _BIAS_KEY]).astype(
            np.float32
        )
    if has_shared:
        (w1, w2), scales = _stack_projections(state_dict, [shared])
        params["shared_w1"], params["shared_w2"] = w1[0], w2[0]
        if scales is not None:
            params["shared_w1_scale"], params["shared_w2_scale"] = scales[0][0], scales[1][0]
    return params


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
            out[name] = np.asarray(quant.dequant_per_block(jnp.asarray(w), jnp.asarray(scale)))
    return out


def load_hf_moe(layer: MoE, state_dict: Mapping[str, Any], prefix: str = "") -> MoE:
    """Assigns one HF MoE block's weights to `layer`, in place, and returns it.

    The layer's structure must match the checkpoint (E, H, I, shared experts, correction bias);
    FP8 checkpoints are dequantized into a float layer and float ones quantized into an FP8 layer.
    Float weights are cast to the layer's param dtype. Works on an abstract layer from
    `nnx.eval_shape`, which it fills completely.

    Raises:
      ValueError: a param the layer has is absent from the checkpoint or vice versa, or a shape
        differs (the message names the param, both shapes and the fix).
    """
    arrays = _layer_arrays(layer, hf_moe_params(state_dict, prefix))
    layer_params = {name for name, v in vars(layer).items() if isinstance(v, nnx.Param)}
    if extra := sorted(set(arrays) - layer_params):
        raise ValueError(
            f"the checkpoint under {prefix!r} has {extra} but the layer does not: build it with "
            "router=RouterConfig(use_correction_bias=True, ...) for e_score_correction_bias and "
            "num_shared_experts > 0 for shared_*"
        )
    if absent := sorted(layer_params - set(arrays)):
        raise ValueError(
            f"the layer has params {absent} that the checkpoint under {prefix!r} "
            "lacks: build the layer without them"
        )
    for name in sorted(layer_params):
        var, value = getattr(layer, name), arrays[name]
        current = var.get_value()
        if tuple(current.shape) != value.shape:
            raise ValueError(
                f"{name}: the layer holds {tuple(current.shape)} but the checkpoint "
                f"under {prefix!r} gives {value.shape}; match hidden_size, "
                "intermediate_size, num_experts and num_shared_experts"
            )
        var.set_value(jnp.asarray(value, dtype=current.dtype))
    return layer


def moe_kwargs_from_hf_config(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    """`MoE` constructor arguments from an HF config (config.json dict or PretrainedConfig).

    Supports model_type "mixtral", "qwen3_moe" and "deepseek_v3" (DeepSeek's "noaux_tc"
    routing: sigmoid scores, grouped top-k, correction bias, routed scaling, shared experts).
    """
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    model_type = config.get("model_type")
    if model_type == "mixtral":
        return dict(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_experts=config["num_local_experts"],
            topk=config["num_experts_per_tok"],
            router=RouterConfig(scoring_func="softmax", renormalize=True),
        )
    if model_type == "qwen3_moe":
        return dict(
            hidden_size=config["hidden_size"],
            intermediate_size=config["moe_intermediate_size"],
            num_experts=config["num_experts"],
            topk=config["num_experts_per_tok"],
            router=RouterConfig(
                scoring_func="softmax", renormalize=bool(config.get("norm_topk_prob", False))
            ),
        )
    if model_type == "deepseek_v3":
        method = config.get("topk_method", "noaux_tc")
        if method != "noaux_tc":
            raise ValueError(f"deepseek_v3 topk_method={method!r}; only 'noaux_tc' is supported")
        return dict(
            hidden_size=config["hidden_size"],
            intermediate_size=config["moe_intermediate_size"],
            num_experts=config["n_routed_experts"],
            topk=config["num_experts_per_tok"],
            num_shared_experts=config.get("n_shared_experts") or 0,
            router=RouterConfig(
                scoring_func=config.get("scoring_func", "sigmoid"),
                renormalize=bool(config.get("norm_topk_prob", True)),
                num_expert_group=config["n_group"],
                topk_group=config["topk_group"],
                use_correction_bias=True,
                routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            ),
        )
    raise ValueError(
        f"model_type={model_type!r}; supported: 'mixtral', 'qwen3_moe', "
        "'deepseek_v3' (or build MoE yourself and call load_hf_moe)"
    )


def moe_from_hf(
    state_dict: Mapping[str, Any], prefix: str, config: Mapping[str, Any] | Any, **layer_kwargs
) -> MoE:
    """An `MoE` holding the HF checkpoint's weights for the layer at `prefix`.

    Builds the layer abstractly (`nnx.eval_shape`, no random init) from `config` and fills it
    with `load_hf_moe`. `layer_kwargs` (dtype, param_dtype, quant_config, experts, chunk_size)
    go to the constructor.

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
