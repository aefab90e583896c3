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
      is_scales_group_major: the backend reads FP8 activation scales [M, K/128] through their
        transpose [K/128, M] (DeepGEMM's MN-major scales, the Mosaic kernel's row-block
        loads). The contiguous layout's producers (permute, act*up + quantize) then write them
        that way, so XLA cancels the transposes and no copy runs between the kernels.
      gathers_rows: the backend's fused GEMM1 reads the contiguous layout's rows from the
        tokens (a `gathered_act_quant` method), so the layer need not copy them.
    """

    name: str = ""
    alignment: int = layouts.DEFAULT_ALIGNMENT
    is_scales_group_major: bool = False
    gathers_rows: bool = False

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
# 2026-12-03 (H200, BENCHMARKS.md "a Mosaic GPU FP8 grouped GEMM"): the Mosaic GPU kernel
# ("mosaic_fp8": persistent, warp-specialised, TMA-fed) on the 64-row segments the Pallas kernel
# also takes from 17 pairs per expert. GEMM1 / GEMM2 us (`gemm_sweep --candidates mosaic`,
# Mosaic vs Pallas): 32 pairs (T=1024) 1908 / 999 vs 1978 / 975; 64 (T=2048) 2261 / 1159 vs
# 2383 / 1162. Whole layer, one call (`bench --decode --variants auto pallas mosaic_fp8`, us,
# Mosaic vs Pallas; DeepGEMM at 96): 16 pairs (T=512) 2988 vs 2846 (Pallas on 32-row segments);
# 24 (T=768) 3012 vs 3048; 32 (T=1024) 3012 vs 3075; 48 (T=1536) 3084 vs 3149; 64 (T=2048) 3681
# vs 3873; 96 (T=3072) 4654 vs 5100 (DeepGEMM 5155). Later the same day (10:36-13:36 UTC
# session), with an expert's row blocks in pairs (`mosaic_fp8_config.heuristic_config`), Mosaic vs
# DeepGEMM in one call: 128 pairs (T=4096) 4730 vs 5711; 192 (T=6144) 6317 vs 6162; 256
# (T=8192) 7995 vs 7813; the prefill shapes (`bench` A, 1024 pairs per expert: 3554 vs 3005;
# B, 512: 1136 vs 941). 2026-12-03 16:12-19:12 UTC session, with overlapped steps and groups of
# 4 (`mosaic_fp8_config.heuristic_config`), one call, two rounds: 192 pairs (T=6144) 6066 / 6053
# vs DeepGEMM 6419 / 6630 (the previous call, before groups of 4: 6325 vs 6359); 256 pairs not
# re-measured. The Mosaic range now ends at 192 pairs.
# So on the contiguous layout "auto" takes Mosaic first above MOSAIC_FP8_MIN_PAIRS_PER_EXPERT and
# up to MOSAIC_FP8_MAX_PAIRS_PER_EXPERT, Pallas next up to PALLAS_MAX_PAIRS_PER_EXPERT; the
# masked layout (measured with Pallas only, in the DeepEP low-latency path) keeps Pallas first.
PALLAS_MAX_PAIRS_PER_EXPERT = 64
MOSAIC_FP8_MIN_PAIRS_PER_EXPERT = 16
MOSAIC_FP8_MAX_PAIRS_PER_EXPERT = 192


def _preference(problem: GemmProblem) -> tuple[str, ...]:
    """The order "auto" tries backends in.

    GPU: DeepGEMM (FP8 and bf16 grouped GEMMs at 1.2+ PFLOPS on the H200), torch's grouped GEMM,
    JAX's Mosaic GPU ragged dot, the Pallas grouped GEMM, then the XLA block loop. With FP8
    weights and few rows per expert (decode) the Pallas grouped GEMM goes first: it pads segments
    to 16-64 rows instead of 128 and makes no torch callback (the crossover was measured for FP8
    only, so bf16 keeps the general order); on the contiguous layout from 17 to 192 pairs per
    expert the Mosaic GPU FP8 kernel ("mosaic_fp8", 64-row segments) goes first (before Pallas
    and DeepGEMM), and a problem it cannot take (N not a multiple of its tile) falls through.
    Elsewhere the XLA loop only: the torch backend runs on the CPU as the twin of its GPU path for
    tests, not to be fast.
    """
    if problem.platform == "gpu":
        tuned = ("deep_gemm", "torch", "mosaic", "xla")
        general = ("deep_gemm", "torch", "mosaic", "pallas", "xla")
        pairs_per_expert = problem.num_pairs / max(problem.num_experts, 1)
        is_mosaic_first = (
            problem.is_fp8
            and problem.layout == "contiguous"
            and MOSAIC_FP8_MIN_PAIRS_PER_EXPERT
            < pairs_per_expert
            <= MOSAIC_FP8_MAX_PAIRS_PER_EXPERT
        )
        if problem.is_fp8 and pairs_per_expert <= PALLAS_MAX_PAIRS_PER_EXPERT:
            return ("mosaic_fp8", "pallas", *tuned) if is_mosaic_first else ("pallas", *tuned)
        return ("mosaic_fp8", *general) if is_mosaic_first else general
    return ("xla",)


GEMMS: Registry[GroupedGemm] = Registry(
    "grouped GEMM",
    preference=_preference,
    modules={
        "deep_gemm": "moe_jax.interop.deep_gemm",
        "torch": "moe_jax.interop.torch_gemm",
        "mosaic": "moe_jax.kernels.mosaic_gemm",
        "mosaic_fp8": "moe_jax.kernels.mosaic_fp8_gemm",
        "mosaic_fp8_interpret": "moe_jax.kernels.mosaic_fp8_gemm",
        "mosaic_fp8_gathered": "moe_jax.kernels.mosaic_fp8_gemm",
        "mosaic_fp8_gathered_interpret": "moe_jax.kernels.mosaic_fp8_gemm",
        "pallas": "moe_jax.kernels.grouped_gemm",
        "pallas_interpret": "moe_jax.kernels.grouped_gemm",
    },
)


def check_contiguous_operands(x, w, expert_ids, x_scales, w_scales) -> None:
    """The shapes every backend's `contiguous` takes, naming the argument at fault: x [M, K],
    w [E, N, K], expert_ids int[M], and scales where given: x_scales [M, ceil(K/128)], w_scales
    [E, ceil(N/128), ceil(K/128)]. Backends add their own rules (dtypes, multiples)."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"{x.shape=} {w.shape=}: need x [M, K] and w [E, N, K] with one K")
    if expert_ids.shape != (x.shape[0],) or not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"{x.shape=} but {expert_ids.shape=} {expert_ids.dtype=}: need int[M]")
    w_groups = quant.block_scale_shape(w.shape)  # [E, ceil(N/128), ceil(K/128)]
    if x_scales is not None and x_scales.shape != (x.shape[0], w_groups[-1]):
        raise ValueError(
            f"{x_scales.shape=} but [M, ceil(K/128)] = {(x.shape[0], w_groups[-1])} is needed "
            f"for {x.shape=}"
        )
    if w_scales is not None and w_scales.shape != w_groups:
        raise ValueError(
            f"{w_scales.shape=} but [E, ceil(N/128), ceil(K/128)] = {w_groups} is needed for "
            f"{w.shape=}"
        )


def dequant_rows(x: jax.Array, x_scales: jax.Array | None) -> jax.Array:
    """float32 view of GEMM activations (FP8 rows times their per-group scales)."""
    if x.dtype == quant.FP8_DTYPE:
        if x_scales is None:
            raise ValueError(f"{x.dtype=} needs x_scales")
        return quant.dequant_per_token_group(x, x_scales)
    return x


def masked_as_contiguous(
    x: jax.Array, x_scales: jax.Array | None, num_rows_per_expert: jax.Array, block_m: int
) -> tuple[jax.Array, jax.Array | None, jax.Array, int]:
    """The masked layout viewed as a contiguous one, for backends with a contiguous kernel.

    Each expert's block of max_m rows, padded to a multiple of `block_m`, becomes one segment;
    rows at or past the expert's count are padding (expert id -1).

    Args:
      x: [E, max_m, K] rows; x_scales: float32[E, max_m, K/128] or None.
      num_rows_per_expert: int[E] valid rows per expert.
      block_m: the kernel's row block.

    Returns:
      (rows [E * R, K], row scales [E * R, K/128] or None, expert_ids int32[E * R], R) with R the
      padded rows per expert; the kernel's [E * R, N] output reshapes to [E, R, N].
    """
    num_experts, max_m, k = x.shape
    rows_per_block = -(-max_m // block_m) * block_m
    pad = ((0, 0), (0, rows_per_block - max_m), (0, 0))
    rows = jnp.arange(rows_per_block, dtype=jnp.int32)
    is_valid = rows[None, :] < num_rows_per_expert.astype(jnp.int32)[:, None]
    expert_ids = jnp.where(is_valid, jnp.arange(num_experts, dtype=jnp.int32)[:, None], -1)
    flat_rows = jnp.pad(x, pad).reshape(num_experts * rows_per_block, k)
    flat_scales = None
    if x_scales is not None:
        flat_scales = jnp.pad(x_scales, pad).reshape(num_experts * rows_per_block, -1)
    return flat_rows, flat_scales, expert_ids.reshape(-1), rows_per_block


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
        check_contiguous_operands(x, w, expert_ids, x_scales, w_scales)
        if not isinstance(alignment, int) or alignment < 1 or x.shape[0] % alignment:
            raise ValueError(
                f"{alignment=} but x.shape={x.shape}: the layout's rows M must be a multiple of "
                "a positive alignment (its segments' multiple)"
            )
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
