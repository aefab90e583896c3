"""Shared plumbing for the Pallas Triton kernels in `moe_jax.kernels`.

The kernels gather and scatter rows by data-dependent indices. On Hopper only the Pallas Triton
backend lowers such indexed loads and stores: Mosaic GPU's indexed TMA copies use `tile::gather4`,
a Blackwell instruction. jax 0.11 deprecates the Triton backend (deprecation id
`jax-pallas-triton`) without a Hopper replacement for indexed copies, so `quiet_triton_deprecation`
hides that one warning while a kernel is traced. Remove it once Mosaic GPU gathers rows on sm_90.

Importing this module changes nothing in JAX: the lowering fix of `_wide_offsets` is installed
when a kernel first builds its compiler parameters (`compiler_params`), before it lowers.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

from jax.experimental.pallas import triton as plt

from moe_jax.kernels import _wide_offsets
from moe_jax.registry import FunctionImpl, OpProblem, Registry, needs_gpu

_TRITON_DEPRECATION = ".*Pallas Triton backend is deprecated.*"


@contextlib.contextmanager
def quiet_triton_deprecation():
    """Ignores the jax>=0.11 Triton-backend DeprecationWarning inside the block, nothing else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)
        yield


def wide_byte_offsets() -> bool:
    """True when Pallas Triton addresses 1-byte arrays of > 2**31 elements with int64 offsets:
    installs `_wide_offsets`' fix of the lowering (once per process) and says whether it is in
    place (False only where this JAX's lowering changed and the fix cannot apply)."""
    return _wide_offsets.install()


def compiler_params(*, num_warps: int, num_stages: int) -> plt.CompilerParams:
    """Triton compiler parameters; passing them selects the Triton backend on GPU. Every kernel
    builds them before it lowers, so this is where `wide_byte_offsets` installs its fix."""
    wide_byte_offsets()
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_power_of_2(value: int) -> int:
    """Smallest power of two >= value (1 for value <= 1); Triton blocks are powers of two."""
    return 1 if value <= 1 else 1 << (value - 1).bit_length()


def largest_power_of_2_divisor(value: int, cap: int) -> int:
    """Largest power of two <= cap that divides value (value > 0)."""
    block = 1
    while block * 2 <= cap and value % (block * 2) == 0:
        block *= 2
    return block


def hidden_block(hidden: int, cap: int, floor: int = 64) -> int:
    """Columns per program: a power-of-two divisor of `hidden` when one >= floor exists (no column
    mask, full-width vector access), else the next power of two of `hidden` capped at `cap` with
    the tail masked. E.g. 7168 -> 1024, 2560 -> 512, 192 -> 64, 100 -> 128 (masked)."""
    divisor = largest_power_of_2_divisor(hidden, cap)
    if divisor >= min(floor, next_power_of_2(hidden)):
        return divisor
    return min(cap, next_power_of_2(hidden))


def register_pallas(
    registry: Registry,
    kernel: Callable[..., Any],
    *,
    compiled_refusal: Callable[[OpProblem], str | None] | None = None,
) -> None:
    """Registers the compiled `kernel` (a wrapper taking `interpret=`) as "pallas": it refuses
    platforms other than NVIDIA GPUs, and whatever `compiled_refusal` refuses. (Its interpret
    mode, a CPU test vehicle, is registered by the tests: tests/interpret_backends.py.)"""

    def refuse(problem: OpProblem) -> str | None:
        why = needs_gpu(problem)
        return why if why is not None or compiled_refusal is None else compiled_refusal(problem)

    registry.register(FunctionImpl("pallas", functools.partial(kernel, interpret=False), refuse))
