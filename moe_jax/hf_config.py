"""Hugging Face model configs -> `moe_jax.flax_layer.MoE` constructor arguments.

Reads configs as transformers 4 and 5 write them: a config.json dict or a `PretrainedConfig`
(through its `to_dict()`). Field names differ between versions; each value is looked up under
all its names, e.g. Qwen3-MoE's expert count is `num_experts` in transformers 4 and
`num_local_experts` in transformers 5 (`config.num_experts` still works as an attribute there).

    model_type   routing                                      MoE fields read
    mixtral      softmax top-k, renormalized                   intermediate_size, num_local_experts
    qwen3_moe    softmax top-k, renormalized if norm_topk_prob  moe_intermediate_size, num_experts
    qwen2_moe    as qwen3_moe, plus a shared expert whose       shared_expert_intermediate_size
                 output is scaled by sigmoid(x @ gate)
    deepseek_v3  "noaux_tc": sigmoid scores, grouped top-k,    n_routed_experts, n_shared_experts,
                 correction bias, routed scaling               n_group, topk_group, ...

Sizes (hidden_size, the intermediate sizes, expert counts, num_experts_per_tok) are required. An
optional field that a config.json omits, or sets to null, takes the default of transformers'
config class (`_DEFAULTS`), so a dict reads as `AutoConfig.from_pretrained` reads it: a
DeepSeek-V3 config without routed_scaling_factor scales by 2.5, as transformers does, not by 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe_jax.flax_layer import RouterConfig

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3")
# HF hidden_act -> MoE activation (HF "gelu" is the exact, erf-based GELU, as MoE's).
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu"}
_FP8_BLOCK = [128, 128]  # the only FP8 weight block `quant.Fp8BlockQuant` supports
_REQUIRED = object()
_QWEN_DEFAULTS = {
    "hidden_act": "silu",
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
# transformers' config-class defaults of the optional fields read here
# (tests/test_hf_transformers.py checks them against the installed transformers).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"hidden_act": "silu"},
    "qwen3_moe": _QWEN_DEFAULTS,
    "qwen2_moe": _QWEN_DEFAULTS,
    "deepseek_v3": {
        "hidden_act": "silu",
        "norm_topk_prob": True,
        "n_group": 8,
        "topk_group": 4,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
    },
}


def hf_config_dict(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    """A plain dict from a config.json mapping or a transformers `PretrainedConfig`."""
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    raise TypeError(
        f"config is a {type(config).__name__}; pass the dict of config.json or a "
        "transformers PretrainedConfig"
    )


def _field(cfg: dict[str, Any], *names: str, default: Any = _REQUIRED) -> Any:
    """The first of `names` that cfg sets (not None); transformers 4 and 5 spell some apart."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    if default is not _REQUIRED:
        return default
    spelled = " or ".join(repr(n) for n in names)
    raise ValueError(
        f"the {cfg.get('model_type')} config lacks {spelled}; pass the model's complete "
        "config.json or PretrainedConfig"
    )


def _read(config: Mapping[str, Any] | Any) -> tuple[str, dict[str, Any]]:
    """(model_type, the config's fields over transformers' defaults; null counts as absent)."""
    cfg = hf_config_dict(config)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config has model_type={model_type!r}, which is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (or build MoE yourself and call load_hf_moe)"
        )
    return model_type, _DEFAULTS[model_type] | {k: v for k, v in cfg.items() if v is not None}


def _check_unsupported(cfg: dict[str, Any], model_type: str) -> None:
    """Raises for options whose semantics `MoE` does not reproduce."""
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method")
        if method != "fp8":
            raise NotImplementedError(
                f"quantization_config.quant_method={method!r}; supported: unquantized weights "
                "and 'fp8' with weight_block_size [128, 128] (DeepSeek-V3)"
            )
        block = list(quant.get("weight_block_size") or [])
        if block != _FP8_BLOCK:
            raise NotImplementedError(
                f"quantization_config.weight_block_size={block}; only {_FP8_BLOCK} FP8 "
                "blocks are supported"
            )
    if model_type != "deepseek_v3":
        return
    method = cfg["topk_method"]
    if method != "noaux_tc":
        raise NotImplementedError(
            f"deepseek_v3 topk_method={method!r}; supported: 'noaux_tc' (DeepSeek-V3's "
            "sigmoid scores + correction bias + grouped top-k)"
        )
    scoring = cfg["scoring_func"]
    if scoring != "sigmoid":
        raise NotImplementedError(
            f"deepseek_v3 scoring_func={scoring!r}; supported: 'sigmoid' (as transformers' "
            "DeepseekV3TopkRouter, which always uses sigmoid)"
        )


def _activation(cfg: dict[str, Any]) -> str:
    act = cfg["hidden_act"]
    if act not in _ACTIVATIONS:
        raise NotImplementedError(
            f"hidden_act={act!r}; supported: {', '.join(_ACTIVATIONS)} (MoE runs silu or gelu)"
        )
    return _ACTIVATIONS[act]


def moe_kwargs_from_hf_config(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    """`MoE` constructor arguments from an HF config (config.json dict or PretrainedConfig).

    Args:
      config: the model's config, as transformers 4 or 5 writes it, with model_type one of
        `SUPPORTED_MODEL_TYPES`.

    Returns:
      hidden_size, intermediate_size, num_experts, topk, router (a `RouterConfig`), activation,
      num_shared_experts for qwen2_moe and deepseek_v3, and has_shared_expert_gate for qwen2_moe
      (its shared expert's per-token sigmoid gate).

    Raises:
      ValueError: an unknown model_type (the message lists the supported ones) or a missing
        field.
      NotImplementedError: an option `MoE` does not reproduce (DeepSeek topk_method other than
        "noaux_tc", scoring_func other than "sigmoid", a hidden_act other than silu/gelu, a
        quantization other than FP8 128x128 blocks, a Qwen2-MoE shared width that is not a
        multiple of moe_intermediate_size); the message lists what is supported.

    Example:
      >>> kw = moe_kwargs_from_hf_config({"model_type": "qwen3_moe", "hidden_size": 8,
      ...     "moe_intermediate_size": 4, "num_local_experts": 4, "num_experts_per_tok": 2})
      >>> kw["num_experts"], kw["router"].renormalize
      (4, False)
    """
    model_type, cfg = _read(config)
    _check_unsupported(cfg, model_type)
    kwargs = dict(
        hidden_size=_field(cfg, "hidden_size"),
        topk=_field(cfg, "num_experts_per_tok"),
        activation=_activation(cfg),
    )
    if model_type == "mixtral":
        return kwargs | dict(
            intermediate_size=_field(cfg, "intermediate_size"),
            num_experts=_field(cfg, "num_local_experts", "num_experts"),
            router=RouterConfig(scoring_func="softmax", renormalize=True),
        )
    intermediate = _field(cfg, "moe_intermediate_size")
    kwargs["intermediate_size"] = intermediate
    if model_type in ("qwen3_moe", "qwen2_moe"):
        kwargs |= dict(
            num_experts=_field(cfg, "num_experts", "num_local_experts"),
            router=RouterConfig(scoring_func="softmax", renormalize=bool(cfg["norm_topk_prob"])),
        )
        if model_type == "qwen2_moe":
            shared = _field(cfg, "shared_expert_intermediate_size")
            if shared % intermediate:
                raise NotImplementedError(
                    f"qwen2_moe shared_expert_intermediate_size={shared} is not a multiple of "
                    f"moe_intermediate_size={intermediate}: MoE's shared experts are "
                    "num_shared_experts * intermediate_size wide"
                )
            kwargs["num_shared_experts"] = shared // intermediate
            kwargs["has_shared_expert_gate"] = True
        return kwargs
    # deepseek_v3
    return kwargs | dict(
        num_experts=_field(cfg, "n_routed_experts", "num_local_experts"),
        num_shared_experts=cfg["n_shared_experts"],
        router=RouterConfig(
            scoring_func="sigmoid",
            renormalize=bool(cfg["norm_topk_prob"]),
            num_expert_group=cfg["n_group"],
            topk_group=cfg["topk_group"],
            use_correction_bias=True,
            routed_scaling_factor=float(cfg["routed_scaling_factor"]),
        ),
    )


def dense_layer_reason(config: Mapping[str, Any] | Any, layer_index: int) -> str | None:
    """Why decoder layer `layer_index` has a dense MLP instead of an MoE block; None if MoE.

    Follows the transformers decoder layers: DeepSeek-V3's first `first_k_dense_replace` layers
    (and, as DeepSeek's own code, layers not divisible by `moe_layer_freq`) are dense; Qwen's
    `mlp_only_layers` and layers with (index + 1) % decoder_sparse_step != 0 are dense; every
    Mixtral layer is MoE.

    Example:
      >>> dense_layer_reason({"model_type": "deepseek_v3", "first_k_dense_replace": 3}, 1)
      'first_k_dense_replace=3 makes layers 0..2 dense'
    """
    model_type, cfg = _read(config)
    if model_type == "deepseek_v3":
        first, freq = cfg["first_k_dense_replace"], cfg["moe_layer_freq"]
        if layer_index < first:
            return f"first_k_dense_replace={first} makes layers 0..{first - 1} dense"
        if layer_index % freq:
            return f"moe_layer_freq={freq} makes only layers divisible by {freq} MoE"
    elif model_type in ("qwen3_moe", "qwen2_moe"):
        if layer_index in cfg["mlp_only_layers"]:
            return f"mlp_only_layers={cfg['mlp_only_layers']} lists it"
        step = cfg["decoder_sparse_step"]
        if (layer_index + 1) % step:
            return (
                f"decoder_sparse_step={step} makes only layers with (index + 1) % {step} == 0 MoE"
            )
        if not _field(cfg, "num_experts", "num_local_experts", default=1):
            return "num_experts=0"
    return None
