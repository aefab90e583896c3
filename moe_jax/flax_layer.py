"""`MoE`: a Flax NNX mixture-of-experts layer on top of `moe_jax.fused_moe`.

Router (float32 logits -> `fused_topk` or DeepSeek `grouped_topk`), routed experts in vLLM's
weight layout (w1 [E, 2I, H] gate rows then up rows, w2 [E, H, I]), optional DeepSeek-style shared
experts, optional FP8 block-quantized weights. The forward is `fused_moe` with the layer's
`experts=` backend and `chunk_size=`, so the layer inherits its numerics and backends.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

try:
    from flax import nnx
    from flax.nnx.nn import initializers
except ImportError as error:  # flax is an optional extra
    raise ImportError(
        f"moe_jax.flax_layer needs Flax: pip install 'moe_jax[flax]' ({error})"
    ) from error

from moe_jax import quant
from moe_jax.activation import act_and_mul, check_activation
from moe_jax.experts import Experts
from moe_jax.experts_by_name import resolve_experts
from moe_jax.fused_moe import fused_moe
from moe_jax.routing import SCORING_FUNCS, fused_topk, grouped_topk, require_int

# Expert weights are NT ([..., out, in]): fan-in is the last axis, the first axis is the expert.
default_kernel_init = initializers.lecun_normal(in_axis=-1, out_axis=-2, batch_axis=(0,))
default_router_init = initializers.lecun_normal()  # router kernel [H, E], as nnx.Linear's
default_bias_init = initializers.zeros_init()
# What `dtype`, `param_dtype` and the tokens may be (FP8 weights come from `quant_config`).
COMPUTE_DTYPES = tuple(map(jnp.dtype, (jnp.bfloat16, jnp.float16, jnp.float32)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """How the router turns float32 logits [T, E] into (topk_weights, topk_ids).

    Attributes:
      scoring_func: "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3).
      renormalize: divide the k weights by their sum (Qwen3's and DeepSeek's `norm_topk_prob`).
      num_expert_group: None routes with `fused_topk` over all experts; G > 0 routes with
        DeepSeek's `grouped_topk` over G equal groups of experts.
      topk_group: groups kept per token; required with `num_expert_group`.
      use_correction_bias: give the layer an `e_score_correction_bias` [E] that steers the choice
        of experts but not their weights (DeepSeek-V3); needs grouped routing.
      routed_scaling_factor: multiplies the final routing weights.
    """

    scoring_func: str = "softmax"
    renormalize: bool = True
    num_expert_group: int | None = None
    topk_group: int | None = None
    use_correction_bias: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"unknown scoring_func {self.scoring_func!r}; choose from {list(SCORING_FUNCS)}"
            )
        if (self.num_expert_group is None) != (self.topk_group is None):
            raise ValueError(
                f"num_expert_group={self.num_expert_group} and topk_group={self.topk_group}: "
                "set both for grouped routing, or neither"
            )
        for name in ("num_expert_group", "topk_group"):
            if getattr(self, name) is not None:
                require_int(name, getattr(self, name))
        if self.num_expert_group is not None and self.num_expert_group <= 0:
            raise ValueError(f"num_expert_group={self.num_expert_group} must be positive")
        if self.use_correction_bias and not self.is_grouped:
            raise ValueError(
                "use_correction_bias=True needs grouped routing: set num_expert_group and "
                "topk_group (num_expert_group=1, topk_group=1 keeps all experts in one group)"
            )

    @property
    def is_grouped(self) -> bool:
        return self.num_expert_group is not None


class MoE(nnx.Module):
    """A mixture-of-experts MLP: router, routed experts, optional shared experts.

    out = sum_j w[t, j] * W2[e] @ (act(W1_gate[e] @ x) * (W1_up[e] @ x)) + shared(x), e = ids[t, j],
    with (w, ids) from the router on float32 logits `x @ router_kernel`.

    Example:
      >>> from flax import nnx
      >>> layer = MoE(16, 8, num_experts=4, topk=2, rngs=nnx.Rngs(0))
      >>> jax.tree.map(jnp.shape, nnx.state(layer, nnx.Param))["w1"]
      Param(
        value=(4, 16, 16)
      )
      >>> y = nnx.jit(lambda m, x: m(x))(layer, jnp.ones((2, 3, 16)))
      >>> y.shape, y.dtype
      ((2, 3, 16), dtype('float32'))

    Args:
      hidden_size: H.
      intermediate_size: I, the width of one routed expert.
      num_experts: E.
      topk: k experts per token.
      router: a `RouterConfig`; the default is softmax top-k, renormalized (Mixtral).
      num_shared_experts: n; n > 0 adds a gated MLP of width n * I applied to every token
        (DeepSeek's shared experts) to the output.
      has_shared_expert_gate: scale the shared experts' output per token by
        sigmoid(x @ shared_gate_kernel) (Qwen2-MoE's `shared_expert_gate`); needs n > 0.
      activation: "silu" or "gelu", on the gate half.
      quant_config: `quant.Fp8BlockQuant()` stores the expert weights (routed and shared) as
        float8_e4m3fn with float32 128x128 block scales; None keeps them in `param_dtype`.
        H, I (and n * I) must be multiples of 128. See also `MoE.quantize`.
      dtype: compute dtype of the experts, bfloat16, float16 or float32 (None: the result type
        of x and the float params; x's dtype once the expert weights are FP8).
        The router always computes in float32.
      param_dtype: dtype of the float params, bfloat16, float16 or float32 (default); the router
        stays in it too.
      kernel_init: initializer of w1, w2 and the shared weights ([..., out, in] shapes).
      router_init: initializer of the router kernel [H, E].
      bias_init: initializer of the correction bias [E].
      experts: backend, passed to `fused_moe`: "auto", "xla", "torch", "deep_gemm",
        "xla_masked", "deep_gemm_masked", or an `Experts` object (like nnx.Linear's
        `dot_general=`).
      chunk_size: run the experts over chunks of at most this many tokens (None: one chunk).
      rngs: random keys for the initializers.

    Attributes (params):
      router_kernel: [H, E] in param_dtype.
      e_score_correction_bias: [E] float32 with `router.use_correction_bias`, else None. DeepSeek
        adjusts it by a load-balancing rule, not by gradients (its gradient is zero).
      w1: [E, 2I, H]; w2: [E, H, I]. float8_e4m3fn under FP8, else param_dtype.
      w1_scale: float32[E, 2I/128, H/128]; w2_scale: float32[E, H/128, I/128]; None unless FP8.
      shared_w1: [2nI, H]; shared_w2: [H, nI]; None without shared experts.
      shared_w1_scale, shared_w2_scale: block scales of the shared weights under FP8, else None.
      shared_gate_kernel: [H, 1] in param_dtype with `has_shared_expert_gate`, else None.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        num_experts: int,
        topk: int,
        router: RouterConfig = RouterConfig(),
        num_shared_experts: int = 0,
        has_shared_expert_gate: bool = False,
        activation: str = "silu",
        quant_config: quant.Fp8BlockQuant | None = None,
        dtype: jnp.dtype | None = None,
        param_dtype: jnp.dtype = jnp.float32,
        kernel_init: nnx.Initializer = default_kernel_init,
        router_init: nnx.Initializer = default_router_init,
        bias_init: nnx.Initializer = default_bias_init,
        experts: str | Experts = "auto",
        chunk_size: int | None = None,
        rngs: nnx.Rngs,
    ):
        for name, value in (
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
            ("num_experts", num_experts),
        ):
            if require_int(name, value) <= 0:
                raise ValueError(f"{name}={value} must be positive")
        if not 1 <= require_int("topk", topk) <= num_experts:
            raise ValueError(f"topk={topk} must be in [1, num_experts={num_experts}]")
        if require_int("num_shared_experts", num_shared_experts) < 0:
            raise ValueError(f"num_shared_experts={num_shared_experts} must be >= 0")
        if has_shared_expert_gate and not num_shared_experts:
            raise ValueError(
                "has_shared_expert_gate=True gates the shared experts: set num_shared_experts > 0"
            )
        if chunk_size is not None and (
            not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0
        ):
            raise ValueError(f"chunk_size={chunk_size!r} must be a positive int or None")
        resolve_experts(experts)  # an unknown name fails here, not at the first call
        if not isinstance(router, RouterConfig):
            raise TypeError(f"router is a {type(router).__name__}; pass a RouterConfig")
        if router.is_grouped:
            groups = router.num_expert_group
            if num_experts % groups:
                raise ValueError(
                    f"num_experts={num_experts} must be a multiple of "
                    f"router.num_expert_group={groups}"
                )
            if not 1 <= router.topk_group <= groups:
                raise ValueError(f"router.topk_group={router.topk_group} must be in [1, {groups}]")
            if topk > router.topk_group * (num_experts // groups):
                raise ValueError(
                    f"topk={topk} exceeds router.topk_group={router.topk_group} "
                    f"groups x {num_experts // groups} experts per group"
                )
            if router.use_correction_bias and num_experts // groups < 2:
                raise ValueError(
                    "a correction bias scores groups by their top-2 experts: "
                    f"num_experts / num_expert_group = {num_experts // groups} < 2"
                )
        check_activation(activation)
        if dtype is not None and jnp.dtype(dtype) not in COMPUTE_DTYPES:
            raise TypeError(
                f"dtype={jnp.dtype(dtype)} but the experts compute in one of "
                f"{[d.name for d in COMPUTE_DTYPES]} (or None: inferred from x and the params)"
            )
        if jnp.dtype(param_dtype) not in COMPUTE_DTYPES:
            raise TypeError(
                f"param_dtype={jnp.dtype(param_dtype)} but one of "
                f"{[d.name for d in COMPUTE_DTYPES]} is needed (FP8 weights: quant_config=)"
            )

        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.topk = topk
        self.router = router
        self.num_shared_experts = num_shared_experts
        self.activation = activation
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.experts = experts
        self.chunk_size = chunk_size
        self.quant_config = None

        h, i, e = hidden_size, intermediate_size, num_experts
        self.router_kernel = nnx.Param(router_init(rngs.params(), (h, e), param_dtype))
        if router.use_correction_bias:
            self.e_score_correction_bias = nnx.Param(bias_init(rngs.params(), (e,), jnp.float32))
        else:
            self.e_score_correction_bias = nnx.data(None)
        self.w1 = nnx.Param(kernel_init(rngs.params(), (e, 2 * i, h), param_dtype))
        self.w2 = nnx.Param(kernel_init(rngs.params(), (e, h, i), param_dtype))
        self.w1_scale = nnx.data(None)
        self.w2_scale = nnx.data(None)
        if num_shared_experts:
            shared = num_shared_experts * i
            self.shared_w1 = nnx.Param(
                kernel_init(rngs.params(), (1, 2 * shared, h), param_dtype)[0]
            )
            self.shared_w2 = nnx.Param(kernel_init(rngs.params(), (1, h, shared), param_dtype)[0])
        else:
            self.shared_w1 = nnx.data(None)
            self.shared_w2 = nnx.data(None)
        self.shared_w1_scale = nnx.data(None)
        self.shared_w2_scale = nnx.data(None)
        if has_shared_expert_gate:
            self.shared_gate_kernel = nnx.Param(router_init(rngs.params(), (h, 1), param_dtype))
        else:
            self.shared_gate_kernel = nnx.data(None)
        if quant_config is not None:
            self.quantize(quant_config)

    @property
    def is_fp8(self) -> bool:
        return self.quant_config is not None

    def quantize(self, quant_config: quant.Fp8BlockQuant | None = None) -> MoE:
        """Replaces the float expert weights (routed and shared) by FP8 ones, in place.

        Uses `quant.per_block_quant_fp8`: float8_e4m3fn weights and float32 128x128 block
        scales in the `*_scale` params. The router and the correction bias stay as they are.

        Args:
          quant_config: the recipe; None means `quant.Fp8BlockQuant()`.

        Returns:
          self, for chaining.
        """
        quant_config = quant.Fp8BlockQuant() if quant_config is None else quant_config
        if not isinstance(quant_config, quant.Fp8BlockQuant):
            raise TypeError(
                f"quant_config is a {type(quant_config).__name__}; "
                "pass a moe_jax.quant.Fp8BlockQuant"
            )
        if self.is_fp8:
            raise ValueError("the layer is already FP8; quantize() takes a float layer")
        block = quant_config.block_shape[0]
        widths = {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size}
        if self.num_shared_experts:
            widths["num_shared_experts * intermediate_size"] = (
                self.num_shared_experts * self.intermediate_size
            )
        for name, width in widths.items():
            if width % block:
                raise ValueError(f"{name}={width}: FP8 block weights need multiples of {block}")
        block_shape = quant_config.block_shape
        for name in ("w1", "w2", "shared_w1", "shared_w2"):
            w = getattr(self, name)
            if w is None:
                continue
            wq, scale = quant.per_block_quant_fp8(w[...], block_shape)
            setattr(self, name, nnx.Param(wq))
            setattr(self, f"{name}_scale", nnx.Param(scale))
        self.quant_config = quant_config
        return self

    def router_logits(self, x: jax.Array) -> jax.Array:
        """float32[T, E] router logits of x [T, H], computed in float32 at full precision."""
        kernel = self.router_kernel[...].astype(jnp.float32)
        return jnp.dot(x.astype(jnp.float32), kernel, precision=jax.lax.Precision.HIGHEST)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(topk_weights float32[T, k], topk_ids int32[T, k]) for tokens x [T, H]."""
        logits = self.router_logits(x)
        r = self.router
        if r.is_grouped:
            bias = self.e_score_correction_bias
            return grouped_topk(
                logits,
                self.topk,
                r.renormalize,
                r.num_expert_group,
                r.topk_group,
                scoring_func=r.scoring_func,
                e_score_correction_bias=None if bias is None else bias[...],
                routed_scaling_factor=r.routed_scaling_factor,
            )
        weights, ids = fused_topk(logits, self.topk, r.renormalize, r.scoring_func)
        if r.routed_scaling_factor != 1.0:
            weights = weights * r.routed_scaling_factor
        return weights, ids

    def compute_dtype(self, x: jax.Array) -> jnp.dtype:
        """The dtype the experts run in for input x: `dtype`, else x's dtype with FP8 expert
        weights, else inferred from x and w1 as in nnx.Linear."""
        if self.dtype is not None:
            return jnp.dtype(self.dtype)
        if self.is_fp8:
            return jnp.dtype(x.dtype)
        return jnp.result_type(x.dtype, self.w1[...].dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the layer to x [..., H]; returns [..., H] in the compute dtype."""
        x = jnp.asarray(x)
        if x.dtype not in COMPUTE_DTYPES:
            raise TypeError(
                f"x.dtype={x.dtype} but bfloat16, float16 or float32 tokens are needed "
                "(cast other inputs, e.g. x.astype(jnp.float32))"
            )
        if x.ndim < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x.shape={x.shape} but [..., H={self.hidden_size}] is needed")
        lead = x.shape[:-1]
        tokens = x.reshape(-1, self.hidden_size)
        dtype = self.compute_dtype(x)
        topk_weights, topk_ids = self.route(tokens)
        h = tokens.astype(dtype)
        w1, w2 = self.w1[...], self.w2[...]
        scales = {}
        if self.is_fp8:
            scales = dict(w1_scale=self.w1_scale[...], w2_scale=self.w2_scale[...])
        else:
            w1, w2 = w1.astype(dtype), w2.astype(dtype)
        out = fused_moe(
            h,
            w1,
            w2,
            topk_weights,
            topk_ids,
            activation=self.activation,
            chunk_size=self.chunk_size,
            experts=self.experts,
            **scales,
        )
        if self.num_shared_experts:
            shared = self._shared(h)
            if self.shared_gate_kernel is not None:
                gate = jax.nn.sigmoid(
                    jnp.dot(
                        tokens.astype(jnp.float32),
                        self.shared_gate_kernel[...].astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST,
                    )
                )
                shared = (gate * shared.astype(jnp.float32)).astype(shared.dtype)
            out = out + shared
        return out.reshape(*lead, self.hidden_size)

    def _shared(self, h: jax.Array) -> jax.Array:
        if self.is_fp8:
            # One expert that every token picks with weight 1: the routed FP8 path and backend.
            num_tokens = h.shape[0]
            return fused_moe(
                h,
                self.shared_w1[...][None],
                self.shared_w2[...][None],
                jnp.ones((num_tokens, 1), jnp.float32),
                jnp.zeros((num_tokens, 1), jnp.int32),
                activation=self.activation,
                w1_scale=self.shared_w1_scale[...][None],
                w2_scale=self.shared_w2_scale[...][None],
                chunk_size=self.chunk_size,
                experts=self.experts,
            )
        w1 = self.shared_w1[...].astype(h.dtype)
        w2 = self.shared_w2[...].astype(h.dtype)
        gate_up = jnp.dot(h, w1.T, preferred_element_type=jnp.float32).astype(h.dtype)
        a = act_and_mul(gate_up, self.activation)
        return jnp.dot(a, w2.T, preferred_element_type=jnp.float32).astype(h.dtype)
