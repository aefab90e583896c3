"""64-bit pointer offsets for 1-byte arrays of more than 2**31 elements in Pallas Triton kernels.

The bug: Pallas Triton (`_compute_offsets_from_indices` in jax/_src/pallas/triton/lowering.py,
jax 0.10 and 0.11) computes a ref's element offsets in int32 unless the whole array exceeds
2**32 *bytes*. For 1-byte dtypes (FP8, int8, uint8) of 2**31 to 2**32 elements the offsets pass
int32's range and wrap negative, so loads and stores touch other memory: DeepSeek-V3's FP8 w2
on one GPU, [256, 7168, 2048] = 3.76e9 elements, is such an array (issue 12).

The fix, applied once by `install()`: for 1-byte arrays of more than 2**31 elements (so the
last offset, n - 1, passes int32) the offset computation is told the element size is 2 bytes,
which puts the array past the 2**32-byte threshold and selects int64 offsets (nothing else in
that function reads the dtype). Sub-byte and bool arrays get the same fix. Arrays of at most
2**31 elements and wider dtypes lower exactly as before.

Remove this module once JAX's threshold counts elements: `tests/test_kernels_wide_offsets.py`
lowers a probe kernel with and without the patch and fails when the unpatched lowering no
longer needs it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from types import ModuleType

import jax.numpy as jnp

INT32_ELEMENTS = 2**31  # element offsets 0 .. 2**31 - 1 fit in int32; more elements do not

_PATCHED_MARK = "_moe_jax_wide_byte_offsets"


def _lowering_module() -> ModuleType | None:
    """jax's Pallas Triton lowering module, or None where this JAX has none to patch."""
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:
        return None
    block_info = getattr(lowering, "BlockInfo", None)
    has_fields = dataclasses.is_dataclass(block_info) and "full_shape_dtype" in {
        field.name for field in dataclasses.fields(block_info)
    }
    if not (has_fields and callable(getattr(lowering, "_compute_offsets_from_indices", None))):
        return None
    return lowering


def needs_wide_offsets(shape: tuple[int, ...], dtype: jnp.dtype | type) -> bool:
    """True for 1-byte arrays whose element offsets pass int32 (more than 2**31 elements)."""
    return jnp.dtype(dtype).itemsize == 1 and math.prod(shape) > INT32_ELEMENTS


def install() -> bool:
    """Patches the lowering (once per process); True when the patch is in place.

    False where this JAX lacks the function or its `BlockInfo.full_shape_dtype` (its lowering
    changed): callers then keep their own workaround (the grouped GEMM's uint16 packing).
    """
    lowering = _lowering_module()
    if lowering is None:
        return False
    original = lowering._compute_offsets_from_indices
    if getattr(original, _PATCHED_MARK, False):
        return True

    @functools.wraps(original)
    def compute_offsets(block_info, *args, **kwargs):
        aval = block_info.full_shape_dtype
        if needs_wide_offsets(tuple(aval.shape), aval.dtype):
            # Only the int32/int64 choice reads the dtype (full_size); 2 bytes forces int64.
            block_info = dataclasses.replace(
                block_info, full_shape_dtype=aval.update(dtype=jnp.dtype(jnp.uint16))
            )
        return original(block_info, *args, **kwargs)

    setattr(compute_offsets, _PATCHED_MARK, True)
    lowering._compute_offsets_from_indices = compute_offsets
    return True
