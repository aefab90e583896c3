"""One plan per experts call: what `ContiguousExperts` runs for a problem, and why.

`plan(problem, ...)` builds a frozen `ExpertsPlan` from a call's static facts
(`moe_jax.experts.ExpertsProblem`: shapes, dtypes, activation, platform) and the user's choices
(per stage a name, an implementation object or "auto"). It is the one place that decides: the
order "auto" tries the grouped GEMMs, the fused GEMM1s and the weight gradients in is computed
here (`gemm_order`, `fused_gemm1_order`, `wgrad_order`, which those registries call), so is the
backward's dgrad (`dgrad_gemm`), and every number they use is in `THRESHOLDS`.
`ContiguousExperts.apply` runs the plan's stages and decides nothing; `python -m moe_jax info
--plan` prints it. Planning runs in Python at trace time.

A plan's stages (`ExpertsPlan.describe` prints them with their reasons and the candidates skipped):

    arrange    "permute": copy each (token, slot) row into the contiguous layout; "route": the
               layout without rows, where GEMM1 gathers them from the tokens
    gemm1      a `GroupedGemm`, or a `FusedGemm1` (GEMM1 + act(gate) * up + FP8 quantization)
    act_quant  act(gate) * up (+ quantization) between the GEMMs, unless GEMM1 fused it
    gemm2      a `GroupedGemm`
    unpermute  the weighted gather back to [T, H]
    alignment  the layout's segment multiple (rows)
    dgrad      the backward's GEMM of each GEMM (dy times w^T), on float rows only
    wgrad      the weight gradient of each GEMM (none for FP8 weights)
    recompute  what the backward recomputes (`RECOMPUTE_POLICIES`)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from moe_jax import grouped_gemm, layouts, quant
from moe_jax.act_quant import ACT_QUANTS
from moe_jax.experts import ExpertsProblem
from moe_jax.fused_gemm1 import FUSED_GEMM1S, FusedGemm1, FusedGemm1Problem
from moe_jax.grouped_gemm import GEMMS
from moe_jax.grouped_gemm_backward import WGRADS
from moe_jax.permute import PERMUTES, UNPERMUTES
from moe_jax.registry import AUTO, NoImplementationError, OpProblem, Registry

FP8 = jnp.dtype(quant.FP8_DTYPE).name


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """Every number "auto" decides with; BENCHMARKS.md's "Thresholds" table holds each one's
    evidence under its name. Pairs per expert are T * k / E, rows per expert M / E."""

    # BENCHMARKS.md "Thresholds": PALLAS_MAX_PAIRS_PER_EXPERT
    PALLAS_MAX_PAIRS_PER_EXPERT: int = 64  # FP8: the Pallas GEMM before DeepGEMM up to here
    # BENCHMARKS.md "Thresholds": MOSAIC_FP8_MIN_PAIRS_PER_EXPERT
    MOSAIC_FP8_MIN_PAIRS_PER_EXPERT: int = 16  # FP8 contiguous: the Mosaic GEMM first above...
    # BENCHMARKS.md "Thresholds": MOSAIC_FP8_MAX_PAIRS_PER_EXPERT
    MOSAIC_FP8_MAX_PAIRS_PER_EXPERT: int = 192  # ... and up to this
    # BENCHMARKS.md "Thresholds": SEGMENT_ROWS_PER_MEAN_PAIR
    SEGMENT_ROWS_PER_MEAN_PAIR: int = 2  # tunable segments: the power of 2 >= this * pairs/expert
    # BENCHMARKS.md "Thresholds": FUSED_ACT_QUANT_MAX_K
    FUSED_ACT_QUANT_MAX_K: int = 2048  # the fused GEMM1 up to this H (K), on 128-row segments
    # BENCHMARKS.md "Thresholds": GATHERED_MAX_N
    GATHERED_MAX_N: int = 1536  # ... in its gathered form up to this 2I (N)
    # BENCHMARKS.md "Thresholds": PALLAS_WGRAD_MAX_ROWS_PER_EXPERT
    PALLAS_WGRAD_MAX_ROWS_PER_EXPERT: int = 768  # the Pallas wgrad before torch's up to here


THRESHOLDS = Thresholds()

RESIDUAL_LAYOUT = "moe_layout"
RESIDUAL_GEMM1 = "moe_gemm1_out"
RESIDUAL_GEMM2 = "moe_gemm2_out"
RECOMPUTE_POLICIES: dict[str, tuple[str, ...] | None] = {
    "none": None,  # no jax.checkpoint: every residual is kept
    "activation": (RESIDUAL_LAYOUT, RESIDUAL_GEMM1, RESIDUAL_GEMM2),
    "gemm2": (RESIDUAL_LAYOUT, RESIDUAL_GEMM1),
    "all": (),
}


def gemm_order(problem: grouped_gemm.GemmProblem) -> tuple[tuple[str, ...], str]:
    """The grouped GEMMs "auto" tries for `problem`, in order, and why (`GEMMS`' preference)."""
    if problem.platform != "gpu":
        return ("xla",), f"on {problem.platform} only the XLA loop (the torch twin is for tests)"
    t = THRESHOLDS
    pairs = problem.num_pairs / max(problem.num_experts, 1)
    if problem.is_fp8 and pairs <= t.PALLAS_MAX_PAIRS_PER_EXPERT:
        order = ("pallas", "deep_gemm", "torch", "mosaic", "xla")
        why = f"FP8, {pairs:g} pairs per expert <= PALLAS_MAX_PAIRS_PER_EXPERT: Pallas first"
    else:
        order = ("deep_gemm", "torch", "mosaic", "pallas", "xla")
        why = f"{pairs:g} pairs per expert{', FP8' if problem.is_fp8 else ''}: DeepGEMM first"
    lo, hi = t.MOSAIC_FP8_MIN_PAIRS_PER_EXPERT, t.MOSAIC_FP8_MAX_PAIRS_PER_EXPERT
    if problem.is_fp8 and problem.layout == "contiguous" and lo < pairs <= hi:
        order = ("mosaic_fp8", *order)
        why += "; within MOSAIC_FP8_MIN/MAX_PAIRS_PER_EXPERT on the contiguous layout: Mosaic FP8"
    return order, why


def fused_gemm1_order(problem: FusedGemm1Problem) -> tuple[tuple[str, ...], str]:
    """The fused GEMM1s "auto" tries for `problem`, in order, and why (`FUSED_GEMM1S`'
    preference); () runs GEMM1 and the act + quantization kernel apart."""
    gemm, t = problem.gemm, THRESHOLDS
    if gemm.platform != "gpu" or not gemm.is_fp8:
        return (), "the fused GEMM1 is an FP8 kernel for GPUs"
    if gemm.k > t.FUSED_ACT_QUANT_MAX_K:
        return (), f"H={gemm.k} > FUSED_ACT_QUANT_MAX_K: GEMM1 and act + quantization apart"
    if gemm.alignment is None or gemm.alignment % 128:
        return (), f"{gemm.alignment}-row segments: fused on 128-row segments only"
    if gemm.n <= t.GATHERED_MAX_N:
        why = f"H={gemm.k} <= FUSED_ACT_QUANT_MAX_K, 2I={gemm.n} <= GATHERED_MAX_N: gathered first"
        return ("mosaic_fp8_gathered", "mosaic_fp8"), why
    return ("mosaic_fp8",), f"2I={gemm.n} > GATHERED_MAX_N: the contiguous fused GEMM1"


def wgrad_order(problem: grouped_gemm.GemmProblem) -> tuple[tuple[str, ...], str]:
    """The weight gradients "auto" tries for `problem` (dw = dy^T x over `num_pairs` layout
    rows), in order, and why (`WGRADS`' preference)."""
    if problem.platform != "gpu":
        return ("xla",), f"on {problem.platform} the XLA block scan"
    rows = problem.num_pairs / max(problem.num_experts, 1)
    if rows <= THRESHOLDS.PALLAS_WGRAD_MAX_ROWS_PER_EXPERT:
        return ("pallas", "torch", "xla"), f"{rows:g} rows per expert: Pallas first"
    return ("torch", "pallas", "xla"), f"{rows:g} rows per expert: torch first"


def dgrad_gemm(
    forward: grouped_gemm.GroupedGemm, problem: grouped_gemm.GemmProblem
) -> tuple[grouped_gemm.GroupedGemm, str, dict[str, str]]:
    """(backend, why, {skipped: why}) of the dgrad of a GEMM that `forward` runs on `problem`:
    dy [rows, N] x w^T [E, K, N] -> [rows, K], the transposed problem (FP8 under FP8 weights or
    the recipe). The forward's backend where it runs it, else "auto"'s first."""
    dgrad = dataclasses.replace(problem, n=problem.k, k=problem.n)
    if (why := forward.unsupported_reason(dgrad)) is None:
        return forward, f"the forward's {forward.name} runs dy x w^T", {}
    impl, reason, skipped = _choose(GEMMS, AUTO, dgrad, argument="gemm", why=gemm_order(dgrad)[1])
    return impl, reason, {forward.name: why, **skipped}


class PlanError(NoImplementationError, ValueError):
    """A choice (or combination) that cannot run the problem, raised while planning; the
    message names the argument. `refusals` maps each refused implementation to its reason."""

    def __init__(self, message: str, refusals: Mapping[str, str] | None = None):
        Exception.__init__(self, message)
        self.refusals = dict(refusals or {})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertsPlan:
    """How one `ContiguousExperts` call runs (module docstring for the stages).

    Attributes:
      problem: the call's static facts.
      gemm1: GEMM1's backend: a `GroupedGemm`, or a `FusedGemm1` that also runs act + quant.
      gemm2: GEMM2's backend.
      alignment: the layout's segment multiple.
      permute_impl: the permute's implementation (name), unless GEMM1 gathers the rows.
      act_quant_impl: act + quantization's implementation (name); None when GEMM1 fused it
        or on the float path (act(gate) * up in XLA).
      unpermute_impl: the weighted gather's implementation (name).
      dgrads: each GEMM's dgrad backend; None without a backward (FP8 rows: inference).
      wgrads: each GEMM's weight-gradient implementation; None for FP8 weights (held constant).
      recipe: the FP8 training recipe, or None.
      recompute: the `RECOMPUTE_POLICIES` name.
      reasons: stage -> why it runs what it runs.
      refusals: stage -> {candidate skipped: why it refused}.
    """

    problem: ExpertsProblem
    gemm1: grouped_gemm.GroupedGemm | FusedGemm1
    gemm2: grouped_gemm.GroupedGemm
    alignment: int
    permute_impl: str | None
    act_quant_impl: str | None
    unpermute_impl: str
    dgrads: tuple[grouped_gemm.GroupedGemm, grouped_gemm.GroupedGemm] | None
    wgrads: tuple[Any, Any] | None
    recipe: Any
    recompute: str
    reasons: Mapping[str, str]
    refusals: Mapping[str, Mapping[str, str]]

    @property
    def fuses_act_quant(self) -> bool:
        return isinstance(self.gemm1, FusedGemm1)

    @property
    def gathers_rows(self) -> bool:
        return self.fuses_act_quant and self.gemm1.gathers_rows

    @property
    def arrange(self) -> str:
        return "route" if self.gathers_rows else "permute"

    @property
    def saved_residuals(self) -> tuple[str, ...] | None:
        """What `jax.checkpoint` keeps (None: no checkpoint, everything is kept)."""
        return RECOMPUTE_POLICIES[self.recompute]

    def stages(self) -> dict[str, str]:
        """Stage -> what runs there, in execution order."""
        fused = " (fused: GEMM1 + act(gate) * up + FP8 quantization)"
        dgrad = "none (FP8 rows: inference)"
        wgrad = "none (FP8 weights are held constant)"
        return {
            "arrange": f"{self.arrange} ({self.permute_impl or 'routing metadata only'})",
            "gemm1": self.gemm1.name + (fused if self.fuses_act_quant else ""),
            "act_quant": self.act_quant_impl or ("in GEMM1" if self.fuses_act_quant else "xla"),
            "gemm2": self.gemm2.name,
            "unpermute": self.unpermute_impl,
            "alignment": f"{self.alignment} rows",
            "dgrad": " / ".join(d.name for d in self.dgrads) if self.dgrads else dgrad,
            "wgrad": " / ".join(w.name for w in self.wgrads) if self.wgrads else wgrad,
            "recompute": self.recompute,
        }

    def describe(self) -> str:
        """The plan as text: each stage, its reason and the candidates skipped."""
        p = self.problem
        lines = [
            f"T={p.num_tokens} k={p.topk} E={p.num_experts} H={p.hidden} I={p.intermediate} "
            f"x {p.x_dtype}, w {p.weight_dtype}, {p.activation}, platform {p.platform}"
            + ("" if self.recipe is None else ", FP8 training recipe")
        ]
        seen = set()
        for stage, runs in self.stages().items():
            lines.append(f"  {stage:<10} {runs}")
            if why := self.reasons.get(stage):
                lines.append(f"  {'':<10}   why: {why}")
            for name, refusal in self.refusals.get(stage, {}).items():
                said = (name, refusal) in seen
                seen.add((name, refusal))
                lines.append(f"  {'':<10}   skipped {name}: {'as above' if said else refusal}")
        return "\n".join(lines)


def _choose(registry: Registry, choice, problem, *, argument: str, why: str | bool = ""):
    """(implementation, reason, {skipped: why}) for `choice` (a name, an object or "auto");
    a refusal raises `PlanError` naming `argument`."""
    try:
        impl = registry.select(choice, problem)
    except NoImplementationError as error:
        raise PlanError(f"{argument}={_label(choice)}: {error}", error.refusals) from None
    except ValueError as error:  # an unknown name
        raise ValueError(f"{argument}={_label(choice)}: {error}") from None
    if choice != AUTO:
        return impl, f"{argument}={_label(choice)} as given", {}
    order = registry.preference(problem)
    skipped = order[: order.index(impl.name)]
    refusals = {n: registry.get(n).unsupported_reason(problem) for n in skipped}
    return impl, f"auto: {why or 'the first of ' + ', '.join(order) + ' that runs'}", refusals


def _label(choice) -> str:
    return repr(choice) if isinstance(choice, str) else repr(getattr(choice, "name", choice))


def _next_power_of_2(value: int) -> int:
    return 1 if value <= 1 else 1 << (value - 1).bit_length()


def segment_alignment(gemm: grouped_gemm.GroupedGemm, problem: grouped_gemm.GemmProblem) -> int:
    """The segment multiple for `gemm` where the caller names none: its `alignment`, or for a
    backend that tiles wider segments too (`max_alignment`), the power of two at least
    `SEGMENT_ROWS_PER_MEAN_PAIR` times the mean pairs per expert, within its range."""
    if gemm.max_alignment is None:
        return gemm.alignment
    pairs = -(-problem.num_pairs // max(problem.num_experts, 1))
    wanted = _next_power_of_2(THRESHOLDS.SEGMENT_ROWS_PER_MEAN_PAIR * pairs)
    return min(gemm.max_alignment, max(gemm.alignment, wanted))


def gemm_problems(
    problem: ExpertsProblem,
    *,
    alignment: int | None,
    dtype: str | None = None,
) -> tuple[grouped_gemm.GemmProblem, grouped_gemm.GemmProblem]:
    """GEMM1's ([rows, H] x w1 [E, 2I, H]) and GEMM2's ([rows, I] x w2 [E, H, I]) problems
    (operands of `dtype`, default the problem's)."""
    common = dict(
        layout="contiguous",
        num_experts=problem.num_experts,
        num_pairs=problem.num_tokens * problem.topk,
        x_dtype=dtype or problem.x_dtype,
        w_dtype=dtype or problem.weight_dtype,
        platform=problem.platform,
        alignment=alignment,
    )
    return (
        grouped_gemm.GemmProblem(n=2 * problem.intermediate, k=problem.hidden, **common),
        grouped_gemm.GemmProblem(n=problem.hidden, k=problem.intermediate, **common),
    )


def masked_gemms(gemm, weights, rows, *, num_pairs: int) -> tuple[tuple, tuple]:
    """((GEMM1's, GEMM2's backends), (their dgrads'; None on FP8 rows)) on the masked layout
    (`MaskedExperts`, `masked_mlp`) for `ExpertWeights` `weights`, rows [E, max_m, H] (float
    rows meeting FP8 weights are quantized in the GEMMs) and at most `num_pairs` routed pairs."""
    dtype = quant.FP8_DTYPE if weights.is_fp8 else rows.dtype
    problems = [
        grouped_gemm.GemmProblem.of(
            jax.ShapeDtypeStruct(rows.shape, dtype), w, layout="masked", num_pairs=num_pairs
        )
        for w in (weights.w1, weights.w2)  # shapes and dtypes as `moe_jax.moe_inputs` checked
    ]
    gemms = tuple(_choose(GEMMS, gemm, p, argument="gemm")[0] for p in problems)
    if rows.dtype == quant.FP8_DTYPE:
        return gemms, (None, None)
    return gemms, tuple(dgrad_gemm(g, p)[0] for g, p in zip(gemms, problems, strict=True))


def check_choices(*, recompute: str, fused_act_quant, recipe) -> None:
    """The choices that fail whatever the problem (`plan` and `ContiguousExperts` check them)."""
    if recompute not in RECOMPUTE_POLICIES:
        raise ValueError(f"recompute={recompute!r}: choose from {sorted(RECOMPUTE_POLICIES)}")
    if recipe is not None and fused_act_quant not in (None, AUTO):
        raise PlanError(
            f"fused_act_quant={_label(fused_act_quant)} runs FP8 inference only; it cannot be "
            "combined with a training recipe"
        )


def plan(
    problem: ExpertsProblem,
    *,
    gemm=AUTO,
    fused_act_quant=AUTO,
    alignment: int | None = None,
    permute_impl: str = AUTO,
    act_quant_impl=AUTO,
    wgrad=AUTO,
    recipe=None,
    recompute: str = "none",
) -> ExpertsPlan:
    """The `ExpertsPlan` of a contiguous-layout call (arguments as `ContiguousExperts`' fields).

    GEMM1's backend sets the segment multiple unless `alignment` is given (`segment_alignment`);
    GEMM2 takes it too ("auto" moves on to a backend that does). `fused_act_quant="auto"` fuses
    GEMM1 only beside `gemm="auto"` and FP8 rows, where `fused_gemm1_order` names a backend that
    runs; a gathered one makes the layer route instead of permuting. Float rows with FP8 weights
    (differentiated with the weights held constant) run like the recipe's: the GEMMs quantize
    the rows, act(gate) * up stays in float, and no fused GEMM1 (a named one is left out).

    Raises:
      PlanError: a named choice refuses the problem, or choices that cannot go together; a
        ValueError (and a `NoImplementationError`) naming the argument.
      TypeError: `recipe` with FP8 weights.
    """
    reasons, refusals = {}, {}

    def note(stage, *chosen):  # one choice, or GEMM1's and GEMM2's
        impls, whys, skipped = zip(*chosen, strict=True)
        reasons[stage] = "; ".join(dict.fromkeys(whys))
        refusals[stage] = {name: why for s in skipped for name, why in s.items()}
        return impls if len(impls) > 1 else impls[0]

    check_choices(recompute=recompute, fused_act_quant=fused_act_quant, recipe=recipe)
    if recipe is not None:
        recipe.check(
            hidden=problem.hidden, intermediate=problem.intermediate, w_dtype=problem.weight_dtype
        )
    fp8_rows, fp8_weights = problem.x_dtype == FP8, problem.weight_dtype == FP8
    quantizes_rows = recipe is not None or (fp8_weights and not fp8_rows)  # in the GEMMs
    gemm_dtype = FP8 if recipe is not None or fp8_weights else None  # None: the problem's
    auto = gemm == AUTO
    p1, _ = gemm_problems(problem, alignment=alignment, dtype=gemm_dtype)
    gemm1 = note("gemm1", _choose(GEMMS, gemm, p1, argument="gemm", why=auto and gemm_order(p1)[1]))
    if alignment is None:
        alignment = segment_alignment(gemm1, p1)
        reasons["alignment"] = f"{gemm1.name}'s segment multiple for this problem"
    else:
        reasons["alignment"] = f"alignment={alignment} as given"
    p1, p2 = gemm_problems(problem, alignment=alignment, dtype=gemm_dtype)
    gemm2 = note("gemm2", _choose(GEMMS, gemm, p2, argument="gemm", why=auto and gemm_order(p2)[1]))
    fused_problem = FusedGemm1Problem(
        gemm=p1, activation=problem.activation, group_size=problem.group_size
    )
    if not quantizes_rows and fused_act_quant not in (None, AUTO):
        fused = _choose(FUSED_GEMM1S, fused_act_quant, fused_problem, argument="fused_act_quant")
        gemm1 = note("gemm1", fused)
    elif not quantizes_rows and fused_act_quant == AUTO and auto:
        names, why = fused_gemm1_order(fused_problem)
        fused = FUSED_GEMM1S.first_accepting(names, fused_problem)
        for name in names[: names.index(fused.name) if fused else None]:
            refusals["gemm1"][name] = FUSED_GEMM1S.get(name).unsupported_reason(fused_problem)
        if fused is not None:
            gemm1, reasons["gemm1"] = fused, f"fused_act_quant='auto': {why}"
        else:
            reasons["gemm1"] += f"; not fused: {why if not names else 'no fused GEMM1 runs'}"
    fused = isinstance(gemm1, FusedGemm1)
    act_quant_name = None
    if fp8_rows and not fused:
        op = OpProblem(
            platform=problem.platform, dtype=problem.mid_dtype, activation=problem.activation
        )
        act = _choose(ACT_QUANTS, act_quant_impl, op, argument="act_quant_impl")
        act_quant_name = note("act_quant", act).name
    permute_name = None
    if fused and gemm1.gathers_rows:
        reasons["arrange"] = f"{gemm1.name} reads the rows from the tokens: no permuted copy"
    else:
        op = OpProblem(platform=problem.platform, dtype=problem.x_dtype)
        rows = _choose(PERMUTES, permute_impl, op, argument="permute_impl")
        permute_name = note("arrange", rows).name
    op = OpProblem(platform=problem.platform, dtype=problem.mid_dtype)
    unpermute = _choose(UNPERMUTES, permute_impl, op, argument="permute_impl")
    unpermute_name = note("unpermute", unpermute).name
    num_rows = layouts.contiguous_num_rows(
        problem.num_tokens, problem.topk, problem.num_experts, alignment
    )
    dgrads = wgrads = None
    if not fp8_rows:  # float rows have a backward
        pairs = ((gemm1, p1), (gemm2, p2))
        dgrads = note(
            "dgrad", *(dgrad_gemm(g, dataclasses.replace(p, num_pairs=num_rows)) for g, p in pairs)
        )
    if not fp8_weights:  # FP8 weights are held constant
        dtype = "bfloat16" if recipe is not None else problem.x_dtype  # dy and x of the wgrad
        chosen = []
        for p in (p1, p2):
            p = dataclasses.replace(p, num_pairs=num_rows, x_dtype=dtype, w_dtype=dtype)
            why = wgrad == AUTO and wgrad_order(p)[1]
            chosen.append(_choose(WGRADS, wgrad, p, argument="wgrad", why=why))
        wgrads = note("wgrad", *chosen)
    return ExpertsPlan(
        problem=problem,
        gemm1=gemm1,
        gemm2=gemm2,
        alignment=alignment,
        permute_impl=permute_name,
        act_quant_impl=act_quant_name,
        unpermute_impl=unpermute_name,
        dgrads=dgrads,
        wgrads=wgrads,
        recipe=recipe,
        recompute=recompute,
        reasons=reasons,
        refusals={k: v for k, v in refusals.items() if v},
    )
