"""Grouped expert GEMMs: the contract, the backend registry, and the XLA reference backend.

Both layouts compute `y[row] = x[row] @ w[expert(row)].T` (NT, as DeepGEMM and vLLM):

- contiguous: x [M, K] in expert-major rows (see `moe_jax.layouts`), expert_ids int32[M] with -1 on
  padding rows, expert_ends int32[E] segment ends; y [M, N]. Rows of padding are unspecified (a
  backend may skip them; DeepGEMM does) and must not be read.
- masked: x [E, max_m, K] with `num_rows_per_expert[e]` valid rows; y [E, max_m, N], rows past the
  count unspecified.

FP8 operands carry vLLM's block scales: x_scales float32 per row per 128 columns, w_scales
float32 [E, ceil(N/128), ceil(K/128)]. The product is
`sum_kb (xq . wq)[kb] * x_scale[kb] * w_scale[n // 128, kb]`, accumulated in float32.

Backends are chosen through the `GEMMS` registry (`moe_jax.registry`): a name, a `GroupedGemm`, or
"auto". Names map to modules that are imported only when asked for, so a backend whose library is
missing stays listed and says why it cannot run.
"""

from __future__ import annotations

import abc
import dataclasses

import jax
import jax.numpy as jnp

from moe_jax import layouts, quant
from moe_jax.registry import Registry

LAYOUTS = ("contiguous", "masked")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmProblem:
    """What a backend must run, in static terms.

    Attributes:
      layout: "contiguous" or "masked".
      n: output columns N (w.shape[1]).
      k: reduction size K (w.shape[2]).
      num_experts: E, experts in w.
      num_pairs: routed (token, slot) pairs the rows hold at most (T * k); with num_experts it
        gives the rows per expert that "auto" weighs (decode-size calls want small row blocks).
      x_dtype: name of the activation dtype ("bfloat16", "float32", "float8_e4m3fn").
      w_dtype: name of the weight dtype.
      platform: "cpu", "gpu", ... as `moe_jax.registry.current_platform()` gives it.
      alignment: contiguous layout: rows per expert segment multiple the caller will use, or None
        to take the backend's own (`GroupedGemm.layout_alignment`).
      max_m: masked layout: rows per expert block.
    """

    layout: str
    n: int
    k: int
    num_experts: int
    num_pairs: int
    x_dtype: str
    w_dtype: str
    platform: str = "cpu"
    alignment: int | None = None
    max_m: int | None = None

    @property
    def is_fp8(self) -> bool:
        return self.w_dtype == "float8_e4m3fn"


class GroupedGemm(abc.ABC):
    """One grouped-GEMM backend. Subclasses set `name` and implement the three methods.

    Attributes:
      name: registry name.
      alignment: the contiguous layout's segment multiple this backend is built for (the
        default of `layout_alignment`).
    """

    name: str = ""
    alignment: int = layouts.DEFAULT_ALIGNMENT

    def layout_alignment(self, problem: GemmProblem) -> int:
        """The segment multiple to build `problem`'s contiguous layout with when the caller
        leaves `GemmProblem.alignment` as None: `alignment`, unless a backend tunes it by the
        rows per expert."""
        del problem
        return self.alignment

    @abc.abstractmethod
    def unsupported_reason(self, problem: GemmProblem) -> str | None:
        """None if this backend runs `problem`, else why not (shown to the user)."""

    @abc.abstractmethod
    def contiguous(
        self,
        x: jax.Array,
        w: jax.Array,
        expert_ids: jax.Array,
        expert_ends: jax.Array,
        *,
        x_scales: jax.Array | None = None,
        w_scales: jax.Array | None = None,
        alignment: int,
        out_dtype: jnp.dtype,
    ) -> jax.Array:
        """[M, K] x [E, N, K] -> [M, N] on the contiguous layout (module docstring)."""

    @abc.abstractmethod
    def masked(
        self,
        x: jax.Array,
        w: jax.Array,
        num_rows_per_expert: jax.Array,
        *,
        x_scales: jax.Array | None = None,
        w_scales: jax.Array | None = None,
        expected_m: int | None = None,
        out_dtype: jnp.dtype,
    ) -> jax.Array:
        """[E, max_m, K] x [E, N, K] -> [E, max_m, N] on the masked layout."""

    def contiguous_dgrad(
        self,
        dy: jax.Array,
        w: jax.Array,
        expert_ids: jax.Array,
        expert_ends: jax.Array,
        *,
        alignment: int,
        out_dtype: jnp.dtype,
    ) -> jax.Array:
        """dx[row] = dy[row] @ w[expert(row)]: [M, N] x [E, N, K] -> [M, K] (NN, the backward of
        `contiguous`). Default: `contiguous` against `jnp.swapaxes(w, 1, 2)` (a physical
        transpose in XLA); backends with an NN kernel override it. Float weights only."""
        return self.contiguous(
            dy,
            jnp.swapaxes(w, 1, 2),
            expert_ids,
            expert_ends,
            alignment=alignment,
            out_dtype=out_dtype,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# Decode crossover: "auto" puts the Pallas grouped GEMM first while the routed pairs per expert
# (T * k / E) are at most this many. H200, 2026-12-02, jax 0.11.2, DeepSeek-V3 experts on one GPU
# (E=256, H=7168, I=2048, k=8, FP8 128x128), whole layer, us per forward, Pallas vs DeepGEMM
# (`python -m moe_jax bench --decode --tokens 1 8 32 128 512 1536 2048`):
#   pairs/expert 1/32 (T=1): 131 vs 179; 1/4 (T=8): 716 vs 970; 1 (T=32): 2155 vs 3228;
#   4 (T=128): 3067 vs 3902; 16 (T=512): 3451 vs 4151; 32 (T=1024): 4652 vs 4468;
#   48 (T=1536): 6052 vs 4647; 64 (T=2048): 7619 vs 4863.
# Pallas wins up to 16 and loses from 32 on: its 16-row tiles waste no padding, but its MMA rate
# is far below DeepGEMM's once the work turns compute-bound. Wider segments (alignment 32 or 64,
# so 32-64-row tiles) win only within noise at T=1024 (4396 vs 4468) and lose at T=1536 (5169
# vs 4647) and T=2048 (6819 vs 4863), so the layout kept 16 then (row blocks launched first).
# BENCHMARKS.md, "Decode-size layers".
# With the kernel's grid launched column tiles first (later the same day, one call): 1/32: 126 vs
# 207; 1/4: 636 vs 900; 1: 1848 vs 3072; 4: 2703 vs 3772; 16: 3092 vs 4048; 32: 4353 vs 4301;
# 48: 6008 vs 4556. The crossover stays between 16 and 32.
# With one multiply-add per element for the block scales and segments of 32 rows from 17 pairs
# per expert (`PallasGemm.layout_alignment`), 2026-12-02 (13-16 UTC session), one call:
# 32 (T=1024): 4123 vs 4246; 64 (T=2048): 6270 vs 4702. The crossover moves to 32.
# With Hopper's FP8 wgmma in the Pallas kernel (`GroupedGemmConfig.is_fp8_wgmma`), 2026-12-02
# 22-23 UTC, one call: 1/32: 123 vs 166; 1/4: 645 vs 892; 1: 1813 vs 3048; 4: 2616 vs 3767;
# 16: 3095 vs 3991; 32: 3288 vs 4270; 48: 3418 vs 4525; 64: 4334 vs 4742 (before the [64, 128]
# untransposed tiles of `heuristic_config`). With those tiles (a second call): 64: 3998 vs 4669;
# 96 (T=3072): 5256 vs 5278; 128 (T=4096): 6426 vs 6059. Pallas wins up to 64 and ties at 96:
# the crossover moves to 64.
# 2026-12-03 (H200, one call each, `scratch` drivers recorded in BENCHMARKS.md): the Mosaic GPU
# kernel ("mosaic_fp8": persistent, warp-specialised, TMA-fed) on the same 64-row segments the
# Pallas kernel takes from 17 pairs per expert, GEMM1 / GEMM2 us: 32 pairs (T=1024) 1957 / 1021
# vs 2037 / 1001; 64 (T=2048) 2315 / 1165 vs 2476 / 1170; whole layer 3096 vs 3174 and 3692 vs
# 4019. At 16 pairs (T=512) the Pallas kernel's 32-row segments stay ahead (1836 / 948 us against
# 1920 / 990 for Mosaic's one-warpgroup form on 64-row segments). So on the contiguous layout
# "auto" takes Mosaic first above MOSAIC_FP8_MIN_PAIRS_PER_EXPERT and up to
# PALLAS_MAX_PAIRS_PER_EXPERT, Pallas second (the masked layout, measured with Pallas only in the
# DeepEP low-latency path, keeps Pallas first).
PALLAS_MAX_PAIRS_PER_EXPERT = 64
MOSAIC_FP8_MIN_PAIRS_PER_EXPERT = 16


def _preference(problem: GemmProblem) -> tuple[str, ...]:
    """The order "auto" tries backends in.

    GPU: DeepGEMM (FP8 and bf16 grouped GEMMs at 1.2+ PFLOPS on the H200), torch's grouped GEMM,
    JAX's Mosaic GPU ragged dot, the Pallas grouped GEMM, then the XLA block loop. With FP8
    weights and few rows per expert (decode) the Pallas grouped GEMM goes first: it pads segments
    to 16-64 rows instead of 128 and makes no torch callback (the crossover was measured for FP8
    only, so bf16 keeps the general order); on the contiguous layout from 17 to 64 pairs per
    expert the Mosaic GPU FP8 kernel ("mosaic_fp8", 64-row segments) goes before it, and a
    problem it cannot take (N not a multiple of its tile) falls through to Pallas. Elsewhere the
    XLA loop only: the torch backend runs on the CPU as the twin of its GPU path for tests, not to
    be fast.
    """
    if problem.platform == "gpu":
        tuned = ("deep_gemm", "torch", "mosaic", "xla")
        pairs_per_expert = problem.num_pairs / max(problem.num_experts, 1)
        if problem.is_fp8 and pairs_per_expert <= PALLAS_MAX_PAIRS_PER_EXPERT:
            is_mosaic_first = (
                problem.layout == "contiguous"
                and pairs_per_expert > MOSAIC_FP8_MIN_PAIRS_PER_EXPERT
            )
            return ("mosaic_fp8", "pallas", *tuned) if is_mosaic_first else ("pallas", *tuned)
        return ("deep_gemm", "torch", "mosaic", "pallas", "xla")
    return ("xla",)


GEMMS: Registry[GroupedGemm] = Registry(
    "grouped GEMM",
    preference=_preference,
    modules={
        "deep_gemm": "moe_jax.interop.deep_gemm",
        "torch": "moe_jax.interop.torch_gemm",
        "mosaic": "moe_jax.kernels.mosaic_gemm",
        "mosaic_fp8": "moe_jax.kernels.mosaic_fp8_gemm",
        "pallas": "moe_jax.kernels.grouped_gemm",
        "pallas_interpret": "moe_jax.kernels.grouped_gemm",
    },
)


def dequant_rows(x: jax.Array, x_scales: jax.Array | None) -> jax.Array:
    """float32 view of GEMM activations (FP8 rows times their per-group scales)."""
    if x.dtype == quant.FP8_DTYPE:
        if x_scales is None:
            raise ValueError(f"{x.dtype=} needs x_scales")
        return quant.dequant_per_token_group(x, x_scales)
    return x


def dequant_weights(w: jax.Array, w_scales: jax.Array | None) -> jax.Array:
    """float32 view of FP8 block-quantized weights; other dtypes pass through."""
    if w.dtype == quant.FP8_DTYPE:
        if w_scales is None:
            raise ValueError(f"{w.dtype=} needs w_scales")
        return quant.dequant_per_block(w, w_scales)
    return w


class XlaGemm(GroupedGemm):
    """Reference backend in plain XLA; FP8 operands are dequantized to float32 first.

    The contiguous GEMM is a loop over `alignment`-row blocks, each against its one expert's
    weights: work-efficient, but not fast on a GPU. (`jax.lax.ragged_dot` is avoided: XLA expands
    it into a masked dense product on GPU and CPU alike, E times the work.)

    Its own segment multiple is 16 rows: a decode-size call pads each routed expert to 16 rows
    rather than 128 (at T=32, k=8 on a CPU that is 8x fewer rows to multiply), and a 16-row block
    still feeds the CPU's matrix units well.
    """

    name = "xla"
    alignment = 16

    def unsupported_reason(self, problem: GemmProblem) -> str | None:
        if problem.layout not in LAYOUTS:
            return f"layout {problem.layout!r} is not one of {LAYOUTS}"
        return None

    def contiguous(
        self, x, w, expert_ids, expert_ends, *, x_scales=None, w_scales=None, alignment, out_dtype
    ):
        a, b = dequant_rows(x, x_scales), dequant_weights(w, w_scales)
        compute = jnp.promote_types(a.dtype, b.dtype)
        a, b = a.astype(compute), b.astype(compute)
        if x.shape[0] == 0:
            return jnp.zeros((0, w.shape[1]), out_dtype)
        y = _blockwise_gemm(a, b, expert_ids, alignment)
        return jnp.where((expert_ids >= 0)[:, None], y, 0).astype(out_dtype)

    def masked(
        self, x, w, num_rows_per_expert, *, x_scales=None, w_scales=None, expected_m=None, out_dtype
    ):
        del expected_m  # a scheduling hint for tuned kernels; the reference needs none
        a, b = dequant_rows(x, x_scales), dequant_weights(w, w_scales)
        compute = jnp.promote_types(a.dtype, b.dtype)
        y = jnp.einsum(
            "emk,enk->emn",
            a.astype(compute),
            b.astype(compute),
            preferred_element_type=jnp.float32,
        )  # default precision: float32 follows jax.default_matmul_precision (TF32 on GPUs)
        is_valid = jnp.arange(x.shape[1])[None, :] < num_rows_per_expert[:, None]
        return jnp.where(is_valid[..., None], y, 0).astype(out_dtype)


def _blockwise_gemm(a: jax.Array, b: jax.Array, expert_ids: jax.Array, block: int) -> jax.Array:
    """y[M, N] for rows whose every `block`-row block belongs to one expert (or is padding)."""
    num_rows, k = a.shape
    blocks = a.reshape(num_rows // block, block, k)
    block_experts = expert_ids.reshape(-1, block)[:, 0]

    def one_block(args):
        rows, expert = args
        y = jnp.dot(rows, b[jnp.maximum(expert, 0)].T, preferred_element_type=jnp.float32)
        return jnp.where(expert >= 0, y, 0.0)

    return jax.lax.map(one_block, (blocks, block_experts)).reshape(num_rows, -1)


GEMMS.register(XlaGemm())
