"""The names `fused_moe(experts=...)` accepts, and the `Experts` object each stands for.

"auto", each GEMM backend of `moe_jax.grouped_gemm.GEMMS` (`ContiguousExperts`), each with the
"_masked" suffix (`MaskedExperts`), and "<gemm>+<fused>" (`ContiguousExperts` with the fused GEMM1
<fused> of `moe_jax.fused_gemm1.FUSED_GEMM1S`).
"""

from __future__ import annotations

import difflib

from moe_jax import grouped_gemm
from moe_jax.contiguous_experts import ContiguousExperts
from moe_jax.experts import Experts
from moe_jax.fused_gemm1 import FUSED_GEMM1S
from moe_jax.masked_experts import MASKED_SUFFIX, MaskedExperts

FUSED_SEPARATOR = "+"  # "<gemm>+<fused>": ContiguousExperts(gemm=<gemm>, fused_act_quant=<fused>)


def experts_names() -> tuple[str, ...]:
    """Names `fused_moe(experts=...)` accepts: "auto", each GEMM backend (contiguous layout),
    each backend with the "_masked" suffix (masked layout), and "<gemm>+<fused>" for each fused
    GEMM1 (GEMM1 with act + quantization by <fused>, the layout and GEMM2 by <gemm>)."""
    gemms = grouped_gemm.GEMMS.names()
    fused = tuple(
        f"{gemm}{FUSED_SEPARATOR}{name}" for gemm in gemms for name in FUSED_GEMM1S.names()
    )
    return ("auto", *gemms, *(name + MASKED_SUFFIX for name in gemms), *fused)


def resolve_experts(experts: str | Experts) -> Experts:
    """An `Experts` object from a name (see `experts_names`) or the object itself.

    "auto" is `ContiguousExperts()`: every stage "auto", planned by `moe_jax.plan` (DeepGEMM,
    torch, Mosaic, then XLA on a GPU, with the Pallas and Mosaic FP8 GEMMs first at decode
    sizes and GEMM1 fused with act*up + quantize where measured faster; XLA elsewhere). "xla"
    is the pure-XLA reference for every stage, the backward's weight gradient included, on every
    platform. Another GEMM name is the contiguous layout with that backend for both GEMMs
    (never fused) and automatic permute, activation and weight-gradient implementations;
    "<gemm>_masked" is the masked layout with that backend; "<gemm>+<fused>" the contiguous
    layout with GEMM1, act and quantization fused by <fused> (FP8 only).

    Raises:
      ValueError: an unknown name (the message lists the base names and the closest ones).
    """
    if isinstance(experts, Experts):
        return experts
    if not isinstance(experts, str):
        raise TypeError(f"experts={experts!r}: pass a name or an Experts object")
    gemms = grouped_gemm.GEMMS.names()
    if experts == "auto":
        return ContiguousExperts()
    if experts == "xla":
        return ContiguousExperts(gemm="xla", permute_impl="xla", act_quant_impl="xla", wgrad="xla")
    if experts in gemms:
        return ContiguousExperts(gemm=experts)
    gemm, separator, fused = experts.partition(FUSED_SEPARATOR)
    if separator and gemm in gemms and fused in FUSED_GEMM1S.names():
        return ContiguousExperts(gemm=gemm, fused_act_quant=fused)
    base = experts.removesuffix(MASKED_SUFFIX)
    if experts.endswith(MASKED_SUFFIX) and base in gemms:
        return MaskedExperts(gemm=base, act_quant_impl="xla" if base == "xla" else "auto")
    close = difflib.get_close_matches(experts, experts_names(), n=3)
    maybe = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    raise ValueError(
        f"unknown experts {experts!r}; {maybe}names: {', '.join(map(repr, ('auto', *gemms)))}, "
        f"each also as '<name>{MASKED_SUFFIX}' (masked layout) or '<name>{FUSED_SEPARATOR}"
        f"<fused>' with <fused> one of {', '.join(map(repr, FUSED_GEMM1S.names()))} (a fused "
        "GEMM1); moe_jax.experts_names() lists them all; or pass an Experts object"
    )
