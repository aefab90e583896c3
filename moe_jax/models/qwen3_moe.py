"""Qwen3-MoE as a Flax NNX model on `moe_jax.flax_layer.MoE`: load, run and train it.

    model = Qwen3MoeForCausalLM.from_pretrained("path/to/checkpoint", dtype=jnp.bfloat16)
    logits = model(input_ids)                          # int32[B, S] -> [B, S, vocab_size]
    optimizer = nnx.Optimizer(model, optax.adamw(3e-4), wrt=nnx.Param)
    metrics = train_step(model, optimizer, input_ids)  # one nnx.jit'ed step, in place

The decoder is transformers' `Qwen3MoeForCausalLM` (the same config fields and checkpoint names;
equal logits at float32 tolerance): token embeddings; per layer, a pre-norm attention block
(grouped-query attention, RMSNorm on each head's q and k, rotary positions, causal) and a pre-norm
MLP block, an `MoE` (softmax top-k router, renormalized with `norm_topk_prob`) or, for layers in
`mlp_only_layers` or off the `decoder_sparse_step` grid, a dense SwiGLU MLP; a final RMSNorm and
the LM head (the embedding matrix with `tie_word_embeddings`). The loss is next-token
cross-entropy plus `router_aux_loss_coef` times transformers' load-balancing loss.
Not covered: a KV cache, sliding-window attention, attention biases, RoPE scaling.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

try:
    from flax import nnx
except ImportError as error:  # flax is an optional extra
    raise ImportError(f"moe_jax.models needs Flax: pip install 'moe_jax[flax]' ({error})") from None

from moe_jax import quant
from moe_jax.experts import Experts
from moe_jax.flax_layer import MoE, RouterConfig
from moe_jax.hf_checkpoint import LazyTensors, checkpoint_weight_map, read_hf_config
from moe_jax.hf_config import dense_layer_reason, hf_config_dict
from moe_jax.hf_loading import load_hf_moe
from moe_jax.hf_weights import dequantize_blocks, to_numpy

MODEL_TYPE = "qwen3_moe"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig:
    """transformers' `Qwen3MoeConfig` fields that the model reads, with transformers' defaults.

    `head_dim` None means hidden_size // num_attention_heads. Layer i is an `MoE` unless i is in
    `mlp_only_layers`, (i + 1) % decoder_sparse_step != 0 or num_experts == 0; a dense layer's
    MLP is `intermediate_size` wide, an expert `moe_intermediate_size`.
    """

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    def __post_init__(self):
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )
        if self.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act={self.hidden_act!r}; Qwen3-MoE uses 'silu'")

    @classmethod
    def from_config_dict(cls, config: Mapping[str, Any] | Any) -> Qwen3MoeConfig:
        """The config of a config.json dict or a transformers `Qwen3MoeConfig` (transformers 4
        or 5: `num_experts` or `num_local_experts`, `rope_theta` or `rope_parameters`).

        Example:
          >>> Qwen3MoeConfig.from_config_dict({"model_type": "qwen3_moe", "num_local_experts": 4,
          ...     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}).rope_theta
          1000000.0
        """
        cfg = {k: v for k, v in hf_config_dict(config).items() if v is not None}
        if cfg.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"model_type={cfg['model_type']!r}; this model is {MODEL_TYPE!r}")
        for flag in ("use_sliding_window", "attention_bias"):
            if cfg.get(flag):
                raise NotImplementedError(f"{flag}=True is not supported (Qwen3-MoE has False)")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise NotImplementedError(f"RoPE scaling {rope} is not supported; 'default' only")
        cfg.setdefault("rope_theta", rope.get("rope_theta", cls.rope_theta))
        cfg.setdefault("num_experts", cfg.get("num_local_experts", cls.num_experts))
        return cls(**{f.name: cfg[f.name] for f in dataclasses.fields(cls) if f.name in cfg})

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` has an `MoE` (else a dense MLP), as transformers says."""
        fields = {**dataclasses.asdict(self), "model_type": MODEL_TYPE}
        return dense_layer_reason(fields, index) is None

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))


class RMSNorm(nnx.Module):
    """weight * x / sqrt(mean(x^2) + eps), normalized in float32 and cast back to x's dtype
    before the weight, as transformers' `Qwen3MoeRMSNorm`."""

    def __init__(self, dim: int, *, eps: float, param_dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[(None,) * (x.ndim - 1)] * normed.astype(x.dtype)


def rotary(num_positions: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """(cos, sin), float32[S, D] each: angle p / theta^(2j/D) at position p, frequency j, with
    the D/2 frequencies repeated (transformers' rotate-half convention)."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(num_positions, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def _apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, S, N, D] rotated by position: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = (a.astype(x.dtype)[None, :, None, :] for a in (cos, sin))
    return x * cos + rotated * sin


class Attention(nnx.Module):
    """Causal grouped-query attention with q/k RMSNorm and rotary positions. `attention_impl`
    is `jax.nn.dot_product_attention`'s `implementation` (None: XLA; "cudnn" on NVIDIA GPUs)."""

    def __init__(self, cfg: Qwen3MoeConfig, make: SimpleNamespace):
        hidden, dim = cfg.hidden_size, cfg.head_dim
        q_width, kv_width = cfg.num_attention_heads * dim, cfg.num_key_value_heads * dim
        self.q_proj, self.o_proj = make.linear(hidden, q_width), make.linear(q_width, hidden)
        self.k_proj, self.v_proj = make.linear(hidden, kv_width), make.linear(hidden, kv_width)
        self.q_norm, self.k_norm = make.norm(dim), make.norm(dim)
        self.head_dim, self.attention_impl = dim, make.attention_impl

    def __call__(self, x, cos, sin, mask):
        b, s, _ = x.shape
        v = self.v_proj(x).reshape(b, s, -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).reshape(b, s, -1, self.head_dim)).astype(v.dtype)
        k = self.k_norm(self.k_proj(x).reshape(b, s, -1, self.head_dim)).astype(v.dtype)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        out = jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=True, implementation=self.attention_impl
        )
        return self.o_proj(out.reshape(b, s, -1))


class MLP(nnx.Module):
    """The dense SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, width: int, make: SimpleNamespace):
        self.gate_proj, self.up_proj = make.linear(hidden, width), make.linear(hidden, width)
        self.down_proj = make.linear(width, hidden)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """x + attn(norm(x)), then h + mlp(norm(h)); the MLP is an `MoE` or an `MLP`."""

    def __init__(self, cfg: Qwen3MoeConfig, index: int, make: SimpleNamespace):
        self.input_layernorm, self.self_attn = make.norm(cfg.hidden_size), Attention(cfg, make)
        self.post_attention_layernorm = make.norm(cfg.hidden_size)
        self.is_moe = cfg.is_moe_layer(index)
        if self.is_moe:
            self.mlp = make.moe(cfg.hidden_size, cfg.moe_intermediate_size)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, make)

    def __call__(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        h = self.post_attention_layernorm(x)
        logits = self.mlp.router_logits(h.reshape(-1, h.shape[-1])) if self.is_moe else None
        return x + self.mlp(h), logits


class Qwen3MoeForCausalLM(nnx.Module):
    """transformers' Qwen3-MoE causal LM (module docstring) on moe_jax's `MoE` layers.

    Example:
      >>> cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=24,
      ...     moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
      ...     num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0])
      >>> model = Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0))
      >>> logits, router_logits = model(jnp.zeros((2, 5), jnp.int32), output_router_logits=True)
      >>> logits.shape, router_logits.shape
      ((2, 5, 32), (1, 10, 4))

    Args:
      config: a `Qwen3MoeConfig`.
      dtype: compute dtype (None: inferred from the params, as nnx.Linear does).
      param_dtype: dtype of every float param (float32 default; bf16 for bf16 training).
      experts: the `MoE` layers' backend, a name of `moe_jax.experts_names()` ("auto", "xla",
        ...) or an `Experts` object, e.g. `ContiguousExperts(recipe=Fp8Training())` to train
        the experts in FP8 (H and moe_intermediate_size multiples of 128).
      quant_config: `quant.Fp8BlockQuant()` holds the expert weights in FP8 (inference, or
        training around frozen experts); None keeps them in param_dtype.
      attention_impl: `jax.nn.dot_product_attention`'s implementation (None: XLA).
      rngs: random keys; weights are normal(0, initializer_range) as in transformers, norms 1.
    """

    def __init__(
        self,
        config: Qwen3MoeConfig,
        *,
        dtype: jnp.dtype | None = None,
        param_dtype: jnp.dtype = jnp.float32,
        experts: str | Experts = "auto",
        quant_config: quant.Fp8BlockQuant | None = None,
        attention_impl: str | None = None,
        rngs: nnx.Rngs,
    ):
        cfg = self.config = config
        init = nnx.initializers.normal(cfg.initializer_range)
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        make = SimpleNamespace(  # the layers' constructors, dtypes and backends bound
            linear=functools.partial(nnx.Linear, use_bias=False, kernel_init=init, **kw),
            norm=functools.partial(RMSNorm, eps=cfg.rms_norm_eps, param_dtype=param_dtype),
            moe=functools.partial(
                MoE,
                num_experts=cfg.num_experts,
                topk=cfg.num_experts_per_tok,
                router=RouterConfig(renormalize=cfg.norm_topk_prob),
                quant_config=quant_config,
                kernel_init=init,
                router_init=init,
                experts=experts,
                **kw,
            ),
            attention_impl=attention_impl,
        )
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, embedding_init=init, **kw)
        self.layers = nnx.List(DecoderLayer(cfg, i, make) for i in range(cfg.num_hidden_layers))
        self.norm = make.norm(cfg.hidden_size)
        tied = cfg.tie_word_embeddings
        self.lm_head = nnx.data(None) if tied else make.linear(cfg.hidden_size, cfg.vocab_size)

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        output_router_logits: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Logits [B, S, vocab_size] (compute dtype) of token ids int[B, S]; attention_mask
        [B, S] (1: a token, 0: padding) keeps queries from attending to padding keys. With
        `output_router_logits`, (logits, float32[L_moe, B*S, E]): each MoE layer's router
        logits, the layers in order (transformers' `router_logits`, stacked)."""
        if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise TypeError(f"{input_ids.shape=} {input_ids.dtype=}: pass int token ids [B, S]")
        cfg = self.config
        x = self.embed_tokens(input_ids)
        cos, sin = rotary(input_ids.shape[1], cfg.head_dim, cfg.rope_theta)
        mask = None if attention_mask is None else attention_mask.astype(bool)[:, None, None, :]
        router_logits = []
        for layer in self.layers:
            x, logits = layer(x, cos, sin, mask)
            router_logits += [] if logits is None else [logits]
        x = self.norm(x)
        logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        if not output_router_logits:
            return logits
        empty = jnp.zeros((0, input_ids.size, cfg.num_experts), jnp.float32)
        return logits, jnp.stack(router_logits) if router_logits else empty

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, Any],
        config: Mapping[str, Any] | Any,
        *,
        dtype: jnp.dtype = jnp.float32,
        **kwargs,
    ) -> Qwen3MoeForCausalLM:
        """The model of transformers' weights: names -> tensors or arrays (possibly lazy), as
        in a checkpoint (per-expert) or a transformers 5 model's `state_dict()` (fused experts).

        Built abstractly (no random init), then filled: MoE blocks by `hf_loading.load_hf_moe`,
        every other param from its name (`model.*.weight`, transposed for linears). FP8
        `weight_scale_inv` block weights are dequantized (experts only into a float `MoE`).
        `config`: a config.json dict, transformers config or `Qwen3MoeConfig`; `dtype`: param
        and compute dtype; `kwargs`: experts, quant_config, attention_impl. Raises KeyError
        (a weight is missing) or ValueError (a shape does not match the config).
        """
        cfg = config
        if not isinstance(cfg, Qwen3MoeConfig):
            cfg = Qwen3MoeConfig.from_config_dict(config)
        model = nnx.eval_shape(
            lambda: cls(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0), **kwargs)
        )
        for i, layer in enumerate(model.layers):
            if layer.is_moe:
                load_hf_moe(layer.mlp, state_dict, f"model.layers.{i}.")
        for path, var in nnx.iter_graph(model):
            if isinstance(var, nnx.Param) and isinstance(var.get_value(), jax.ShapeDtypeStruct):
                *module, leaf = map(str, path)
                name = ".".join([*module, "weight"])
                name = name if module[0] == "lm_head" else f"model.{name}"
                var.set_value(_read(state_dict, name, var.get_value(), leaf == "kernel"))
        return model

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs) -> Qwen3MoeForCausalLM:
        """`from_state_dict` of a checkpoint directory (config.json + safetensors) or its
        config.json, read lazily tensor by tensor (needs safetensors and torch: `moe_jax[hf]`)."""
        config = read_hf_config(path)
        with LazyTensors(checkpoint_weight_map(path)) as tensors:
            return cls.from_state_dict(tensors, config, **kwargs)


def _read(state_dict: Mapping[str, Any], name: str, like: jax.ShapeDtypeStruct, transpose: bool):
    """state_dict[name] as `like` (dequantized if FP8, transposed for an nnx.Linear kernel)."""
    if name not in state_dict:
        raise KeyError(f"{name} is not in the weights; pass the checkpoint the config belongs to")
    w = to_numpy(state_dict[name])
    if f"{name}_scale_inv" in state_dict:
        scale = to_numpy(state_dict[f"{name}_scale_inv"])
        w = dequantize_blocks(w, scale, np.empty(w.shape, np.float32))
    w = w.T if transpose else w
    if w.shape != like.shape:
        raise ValueError(
            f"{name}: the config gives {like.shape} but the weights {w.shape} "
            f"({'transposed ' if transpose else ''}); pass the checkpoint's own config.json"
        )
    return jnp.asarray(w, like.dtype)


def load_balancing_loss(
    router_logits: jax.Array, *, top_k: int, attention_mask: jax.Array | None = None
) -> jax.Array:
    """transformers' `load_balancing_loss_func` (Switch Transformer, eqs. 4-6), float32 scalar.

    E * sum_e f_e * P_e over router_logits float[L, T, E] (T = B*S, as the model returns them):
    f_e is the share of the top_k choices that go to expert e (no gradient), P_e the mean
    softmax probability of e, both over all layers and the tokens attention_mask [B, S] keeps.

    Example:
      >>> float(load_balancing_loss(jnp.zeros((2, 6, 4)), top_k=2))  # uniform: k
      2.0
    """
    num_layers, num_tokens, num_experts = router_logits.shape
    if num_layers == 0:
        return jnp.zeros((), jnp.float32)
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    chosen = jax.nn.one_hot(jax.lax.top_k(probs, top_k)[1], num_experts).sum(-2)
    weight = jnp.ones((num_tokens,), jnp.float32)
    if attention_mask is not None:
        weight = attention_mask.reshape(num_tokens).astype(jnp.float32)
    rows = num_layers * weight.sum()
    tokens_per_expert = jnp.einsum("lte,t->e", chosen, weight) / rows
    prob_per_expert = jnp.einsum("lte,t->e", probs, weight) / rows
    return num_experts * jnp.sum(tokens_per_expert * prob_per_expert)


def next_token_loss(
    logits: jax.Array, input_ids: jax.Array, attention_mask: jax.Array | None = None
) -> jax.Array:
    """float32 mean cross-entropy of logits[:, t] against input_ids[:, t + 1] over the targets
    that attention_mask keeps (transformers' causal LM loss with labels = input_ids)."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, input_ids[:, 1:, None], axis=-1)[..., 0]
    weight = jnp.ones_like(nll) if attention_mask is None else attention_mask[:, 1:]
    weight = weight.astype(jnp.float32)
    return jnp.sum(nll * weight) / jnp.sum(weight)


def model_loss(
    model: Qwen3MoeForCausalLM, input_ids: jax.Array, attention_mask: jax.Array | None = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metrics): loss = next-token cross-entropy + router_aux_loss_coef * aux loss, as
    transformers' `Qwen3MoeForCausalLM(labels=input_ids, output_router_logits=True).loss`;
    metrics: cross_entropy, aux_loss (float32 scalars), expert_load (int32[L_moe, E], top-k
    choices per expert and MoE layer, padding included)."""
    cfg = model.config
    logits, router_logits = model(input_ids, attention_mask, output_router_logits=True)
    ce = next_token_loss(logits, input_ids, attention_mask)
    k = cfg.num_experts_per_tok
    aux = load_balancing_loss(router_logits, top_k=k, attention_mask=attention_mask)
    ids = jax.lax.top_k(router_logits, k)[1].reshape(router_logits.shape[0], -1)
    load = jax.vmap(lambda i: jnp.bincount(i, length=cfg.num_experts))(ids)
    loss = ce + cfg.router_aux_loss_coef * aux
    return loss, dict(cross_entropy=ce, aux_loss=aux, expert_load=load)


@nnx.jit
def train_step(
    model: Qwen3MoeForCausalLM,
    optimizer: nnx.Optimizer,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """One optimizer step on `model_loss`, in place, as one `nnx.jit` program; `optimizer` is
    e.g. AdamW: `nnx.Optimizer(model, optax.adamw(3e-4), wrt=nnx.Param)`. Returns the metrics
    of `model_loss` and "loss", before the update."""
    grad_fn = nnx.value_and_grad(model_loss, has_aux=True)
    (loss, metrics), grads = grad_fn(model, input_ids, attention_mask)
    optimizer.update(model, grads)
    return dict(loss=loss, **metrics)
