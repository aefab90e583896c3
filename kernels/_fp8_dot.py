"""Opt-in FP8 wgmma for named Pallas Triton kernels: the `maxNumImpreciseAcc` of their dots.

Pallas' Triton lowering of `dot_general` (jax 0.10-0.11, `_dot_general_lowering`) builds
`tt.dot` without the `maxNumImpreciseAcc` attribute, i.e. 0: "accumulate FP8 products exactly".
Triton then does not use Hopper's FP8 wgmma, whose accumulator is less precise than float32;
it upcasts both operands to half precision and runs `mma.sync`. Triton's own `tl.dot` sets the
attribute for FP8 operands, so a Triton kernel gets FP8 wgmma where a Pallas one does not
(BENCHMARKS.md, "Prefill").

`allow_imprecise_accumulation(name, max_k)` gives every FP8 x FP8 dot of the Pallas kernel
called `name` the attribute `max_k`: the tensor core may sum up to `max_k` products of K before
the sum reaches a float32 accumulator. A kernel whose dots span one 128-wide K block and whose
results are scaled and summed in float32 right after (the grouped GEMM's FP8 path) then
computes DeepGEMM's and vLLM's recipe. Other kernels and other dots lower as before: the patch
of the lowering (installed on first use, once per process) reads the name of the kernel being
lowered and changes nothing for names that were not registered. While a registered kernel's
dot lowers, the patch swaps the lowering module's `tt_dialect` for a wrapper; JAX lowers Pallas
kernels on the calling thread, so two threads lowering Pallas kernels at that very moment could
see it (the other thread's FP8 dots would get the attribute too).
"""

from __future__ import annotations

import functools
import re
from types import ModuleType
from typing import Any

import jax.numpy as jnp
from jax import lax

_PATCHED_MARK = "_moe_jax_fp8_imprecise_accumulation"
_LIMITS: dict[str, int] = {}  # _key(kernel name) -> maxNumImpreciseAcc of its FP8 dots


def _key(name: str | None) -> str:
    """A kernel name without its punctuation: Pallas rewrites some characters of the name it
    gives `pallas_call` ('=' becomes '_') before the lowering sees it."""
    return re.sub(r"[^0-9A-Za-z]", "", name or "")


def _lowering_module() -> ModuleType | None:
    """jax's Pallas Triton lowering module where it has what the patch needs, else None."""
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:
        return None
    rules = getattr(lowering, "triton_lowering_rules", None)
    dialect = getattr(lowering, "tt_dialect", None)
    if not isinstance(rules, dict) or lax.dot_general_p not in rules or dialect is None:
        return None
    return lowering


class _DialectWithImpreciseDots:
    """`tt_dialect` whose `dot` sets maxNumImpreciseAcc (every other name is the real one's)."""

    def __init__(self, dialect: Any, limit: int):
        self._dialect, self._limit = dialect, limit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dialect, name)

    def dot(self, a, b, c, **kwargs):
        kwargs.setdefault("max_num_imprecise_acc", self._limit)
        return self._dialect.dot(a, b, c, **kwargs)


def install() -> bool:
    """Wraps the lowering's `dot_general` rule (once per process); True when in place."""
    lowering = _lowering_module()
    if lowering is None:
        return False
    original = lowering.triton_lowering_rules[lax.dot_general_p]
    if getattr(original, _PATCHED_MARK, False):
        return True

    @functools.wraps(original)
    def dot_general_rule(ctx, *args, **params):
        limit = _LIMITS.get(_key(getattr(ctx.context, "name", None)))
        is_fp8 = all(jnp.dtype(aval.dtype).itemsize == 1 for aval in ctx.avals_in[:2])
        if limit is None or not is_fp8:
            return original(ctx, *args, **params)
        dialect = lowering.tt_dialect
        lowering.tt_dialect = _DialectWithImpreciseDots(dialect, limit)
        try:
            return original(ctx, *args, **params)
        finally:
            lowering.tt_dialect = dialect

    setattr(dot_general_rule, _PATCHED_MARK, True)
    lowering.triton_lowering_rules[lax.dot_general_p] = dot_general_rule
    return True


def allow_imprecise_accumulation(name: str, max_k: int) -> bool:
    """Lets the FP8 dots of the Pallas kernel `name` sum up to `max_k` products in the tensor
    core's accumulator (FP8 wgmma on Hopper). False where this JAX cannot be patched: the
    kernel then lowers as before (exact accumulation)."""
    if max_k < 1:
        raise ValueError(f"{max_k=} but a positive number of K products is needed")
    if not install():
        return False
    _LIMITS[_key(name)] = max_k
    return True
