"""Zero-copy torch calls from inside `jax.jit`, on XLA's CUDA stream (or on the CPU).

`torch_callback(fn, result_shape_dtypes)` returns a JAX-traceable function. Each call lowers to one
`jax.experimental.buffer_callback` custom call; when XLA executes it, the callback

1. wraps every operand and every XLA-allocated result buffer as a torch tensor through DLPack
   (same memory, no copy; float8_e4m3fn crosses too),
2. makes XLA's stream (`ctx.stream`) torch's current CUDA stream, so kernels that torch or a
   torch-hosted library (DeepGEMM) launch run in XLA's stream order, with no device-wide sync,
3. calls `fn(out, *args)`, which must write the results into `out` in place.

On the CPU the same path runs with torch CPU tensors (`ctx.stream` does not exist there), so CI
exercises the bridge end to end. Under `shard_map` the callback runs once per shard, with that
shard's buffers and stream.

Per-call host work is kept small: shape bookkeeping at trace time, DLPack capsules made and
consumed directly, one `torch.cuda.ExternalStream` cached per XLA stream. The custom call is
declared free of side effects, so a jitted function holding it keeps JAX's C++ dispatch (an
effectful executable runs pjit's Python path on every call; `tests/test_interop_bridge.py`
checks that none runs).

Hazards, stated plainly:
- Tensors handed to `fn` alias XLA buffers that live only for the call: `fn` must not keep them.
- `fn` must leave its work in the current stream's order (join any side stream before returning).
- With `command_buffer_compatible=True` XLA may capture the call into a CUDA graph and replay it
  without running Python: `fn` must then launch the same kernels on every call, allocate nothing
  (torch's allocator does not know the graph), and read nothing from the device on the host.
- torch's CUDA context must exist before the first jitted call (created inside a callback,
  every later call ran about 10x slower). Tracing a call on a GPU backend initialises it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental.buffer_callback import buffer_callback

from moe_jax.registry import current_platform

TORCH_INSTALL_HINT = "pip install 'moe_jax[torch]'"
_KDL_CPU = 1  # DLPack device type of host memory (kDLCPU)


def import_torch():
    """Returns the torch module, or raises ImportError saying how to install it."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"moe_jax.interop needs torch: {TORCH_INSTALL_HINT}") from e
    return torch


@functools.cache
def _init_torch_cuda() -> None:
    """Creates torch's CUDA context on every visible device, from the (main) tracing thread."""
    torch = import_torch()
    for i in range(torch.cuda.device_count()):
        torch.zeros((), device=f"cuda:{i}")


def _as_shape_dtypes(result_shape_dtypes) -> tuple[tuple[jax.ShapeDtypeStruct, ...], bool]:
    is_single = hasattr(result_shape_dtypes, "shape")
    results = (result_shape_dtypes,) if is_single else tuple(result_shape_dtypes)
    if not results:
        raise ValueError("result_shape_dtypes is empty: fn must write at least one result")
    for r in results:
        if not (hasattr(r, "shape") and hasattr(r, "dtype")):
            raise TypeError(f"result_shape_dtypes holds {r!r}; expected jax.ShapeDtypeStruct")
    return tuple(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in results), is_single


class _StreamSwitch:
    """Sets torch's current CUDA stream to an XLA stream and back, with one ExternalStream each.

    The stream pointer XLA passes is stable for a given device and executable, so after the first
    call the cost is a dict lookup and two C calls.
    """

    def __init__(self, torch):
        self._torch = torch
        self._streams: dict[int, tuple[Any, tuple[int, int, int]]] = {}
        self._get = getattr(torch._C, "_cuda_getCurrentStream", None)
        self._set = getattr(torch._C, "_cuda_setStream", None)

    def enter(self, stream_ptr: int, device_index: int) -> Any:
        entry = self._streams.get(stream_ptr)
        if entry is None:
            torch = self._torch
            stream = torch.cuda.ExternalStream(
                stream_ptr, device=torch.device("cuda", device_index)
            )
            entry = (stream, (stream.stream_id, stream.device_index, stream.device_type))
            self._streams[stream_ptr] = entry
        if self._get is None or self._set is None:  # private entry points gone: public API
            context = self._torch.cuda.stream(entry[0])
            context.__enter__()
            return context
        previous = self._get(device_index)
        stream_id, index, device_type = entry[1]
        self._set(stream_id=stream_id, device_index=index, device_type=device_type)
        return previous

    def exit(self, previous: Any) -> None:
        if isinstance(previous, tuple):
            self._set(stream_id=previous[0], device_index=previous[1], device_type=previous[2])
        else:
            previous.__exit__(None, None, None)


def torch_callback(
    fn: Callable[..., None],
    result_shape_dtypes: jax.ShapeDtypeStruct | Sequence[jax.ShapeDtypeStruct],
    *,
    command_buffer_compatible: bool = False,
    vmap_method: str | None = None,
) -> Callable[..., Any]:
    """Wraps `fn(out, *args)`, a torch function writing into `out`, as a JAX-traceable function.

    Args:
      fn: called as `fn(out, *args)` with torch tensors: `out` is one tensor when
        `result_shape_dtypes` is one `ShapeDtypeStruct`, else a tuple of them; `args` are the
        JAX array arguments, read-only by contract. It runs on XLA's stream (torch's current stream
        during the call) and returns None.
      result_shape_dtypes: shape and dtype of each result (XLA allocates them).
      command_buffer_compatible: let XLA capture the call into a CUDA graph (module docstring
        says what `fn` must then obey). Ignored on the CPU.
      vmap_method: forwarded to `buffer_callback` (None: `vmap` raises).

    Returns:
      A function of JAX arrays returning jax.Array results shaped like `result_shape_dtypes`.

    Example (needs torch, an optional dependency, so the docstring runner skips it;
    `tests/test_interop_bridge.py::test_docstring_example` runs it where torch is installed):
      >>> import jax.numpy as jnp
      >>> torch = import_torch()  # doctest: +SKIP
      >>> def add_one(out, x):
      ...     torch.add(x, 1, out=out)
      >>> f = torch_callback(add_one, jax.ShapeDtypeStruct((3,), jnp.float32))  # doctest: +SKIP
      >>> jax.jit(f)(jnp.arange(3.0)).tolist()  # doctest: +SKIP
      [1.0, 2.0, 3.0]
    """
    results, is_single = _as_shape_dtypes(result_shape_dtypes)
    torch = import_torch()
    from_capsule = torch._C._from_dlpack
    switch = _StreamSwitch(torch)

    # A Buffer's __dlpack__ ignores `stream` (no sync is inserted), and the unversioned capsule
    # carries no read-only flag, so this is torch.from_dlpack minus its per-call stream query.
    def callback(ctx, out, *args):
        out_tensors = tuple([from_capsule(o.__dlpack__()) for o in out])
        in_tensors = [from_capsule(a.__dlpack__()) for a in args]
        result = out_tensors[0] if is_single else out_tensors
        device_type, device_index = out[0].__dlpack_device__()
        if device_type == _KDL_CPU:
            fn(result, *in_tensors)
            return
        previous = switch.enter(ctx.stream, device_index)
        try:
            fn(result, *in_tensors)
        finally:
            switch.exit(previous)

    call = buffer_callback(
        callback,
        results,
        command_buffer_compatible=command_buffer_compatible,
        vmap_method=vmap_method,
    )

    def traced(*args: jax.Array):
        if current_platform() == "gpu":
            _init_torch_cuda()
        outs = call(*args)
        return outs[0] if is_single else tuple(outs)

    return traced
