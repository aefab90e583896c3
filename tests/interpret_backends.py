"""The kernels' interpret-mode backends, registered for the tests (`conftest.pytest_configure`).

Production registries hold what a user may pass. The tests also run every Pallas kernel in
Pallas interpret mode on the CPU (the same kernel body, run by XLA ops): each is registered here
as "<name>_interpret" beside its compiled "<name>", accepting every platform; "auto" never picks
it (no registry's preference names it). Processes started by tests (`python -m moe_jax ...`)
do not have these names.
"""

from __future__ import annotations

import functools
import importlib

from moe_jax.registry import FunctionImpl, Registry


def _register(registry: Registry, name: str, path: str) -> None:
    """`registry`'s `name`: the function at `path` ("module:function") with interpret=True."""
    module, _, function = path.partition(":")
    fn = getattr(importlib.import_module(f"moe_jax.kernels.{module}"), function)
    registry.register(FunctionImpl(name, functools.partial(fn, interpret=True)))


def register_interpret_backends() -> None:
    """Registers every kernel's interpret-mode backend (once per process)."""
    from moe_jax import act_quant, grouped_gemm_backward, permute

    for registry, path in (
        (permute.PERMUTES, "permute:gather_rows"),
        (permute.UNPERMUTES, "unpermute:unpermute"),
        (permute.COUNTS, "count:count_expert_num_tokens"),
        (permute.ROUTING_METADATA, "routing_metadata:routing_metadata"),
        (act_quant.GROUP_QUANTS, "act_quant:group_quant"),
        (act_quant.ACT_QUANTS, "act_quant:act_and_quant"),
        (grouped_gemm_backward.WGRADS, "wgrad:grouped_wgrad"),
    ):
        if "pallas_interpret" not in registry.names():
            _register(registry, "pallas_interpret", path)
    _register_gemms()


def _register_gemms() -> None:
    """The grouped GEMMs' interpret twins ("pallas_interpret", "mosaic_fp8_interpret") and the
    fused GEMM1s' ("mosaic_fp8_interpret", "mosaic_fp8_gathered_interpret"), as objects."""
    from moe_jax.fused_gemm1 import FUSED_GEMM1S
    from moe_jax.grouped_gemm import GEMMS
    from moe_jax.kernels.grouped_gemm import PallasGemm
    from moe_jax.kernels.mosaic_fp8_gemm import MosaicFp8FusedGemm1, MosaicFp8Gemm

    for registry, backend in (
        (GEMMS, PallasGemm(name="pallas_interpret", interpret=True)),
        (GEMMS, MosaicFp8Gemm(interpret=True)),
        (FUSED_GEMM1S, MosaicFp8FusedGemm1(interpret=True)),
        (FUSED_GEMM1S, MosaicFp8FusedGemm1(interpret=True, gathers_rows=True)),
    ):
        if backend.name not in registry.names():
            registry.register(backend)
