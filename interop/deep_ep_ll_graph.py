"""DeepEP low-latency calls that XLA may capture into CUDA graphs
(`DeepEPLowLatency(command_buffer_compatible=True)`).

Why: at 128 tokens per rank an LL dispatch -> combine round trip through the DLPack bridge is
bound by host time (DLPack imports, DeepEP's Python wrapper, a Triton launch per callback;
BENCHMARKS.md). When XLA captures the callbacks into its command buffers (CUDA graphs), a replay
launches the recorded kernels and runs no Python.

What a capture needs, and how `LLCaptureState` provides it:

1. No cudaMalloc while XLA captures. DeepEP allocates its receive tensors with torch on every
   dispatch, so the callbacks allocate from a private torch memory pool (`torch.cuda.MemPool`)
   that `DeepEPLowLatency.warm_up` fills first: one eager round trip on XLA's own stream (torch
   caches blocks per stream), which also compiles and loads the Triton receive copy. Blocks of
   the private pool serve no tensor outside these callbacks, so nothing else can alias the memory
   a replay writes.
2. Replays must keep alternating DeepEP's two LL buffers. DeepEP picks the buffer on the host
   (it flips an index at every call), so a capture freezes the choice: the dispatch is recorded on
   one buffer, its combine on the other, and every replay repeats them. That stays correct while
   every captured dispatch used the buffer of the warm-up's dispatch and every combine the other
   one: `LLCaptureState.check` asserts this at each host call (a capture or a re-capture) from the
   address DeepEP reports for its next buffer, and raises instead of recording a call on the wrong
   buffer (on replay that would read stale signals: wrong rows or a hang).
3. XLA re-captures a call when the addresses of its buffers change (its trace cache is keyed on
   them). A combine writing straight into the program's output would be re-captured on every
   call whose output buffer moved, without its dispatch (the check above then refuses it), so in
   this mode the combine writes a temporary that one select copies out (`combine_output`).

Contract for callers: a jitted program that dispatches in this mode must combine that dispatch in
the same program, as `ModularMoE` does. A program that only dispatches would replay its
dispatch on one buffer, which no host-side check can see.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from moe_jax.interop.deep_ep_layouts import DeepEPProblem

PHASES = ("dispatch", "combine")


@dataclasses.dataclass(eq=False)
class LLCaptureState:
    """Host-side state of one `DeepEPLowLatency` in command-buffer mode (module docstring).

    Attributes:
      buffer: the adapter's `deep_ep.Buffer`.
      problem: the adapter's `DeepEPProblem`.
      num_host_calls: DeepEP calls the adapter's capturable callbacks made from Python (each
        capture or re-capture; every call on the CPU, where nothing is captured; a replay adds
        none), for checking that XLA replays. The warm-up is not counted.
      dispatch_buffer_address: address of the LL buffer every captured dispatch must use (the
        warm-up dispatch's), or None before the warm-up.
      pool: the private `torch.cuda.MemPool`, or None on the CPU.
    """

    buffer: Any
    problem: DeepEPProblem
    num_host_calls: int = 0
    dispatch_buffer_address: int | None = None
    pool: Any = None

    @property
    def is_warm(self) -> bool:
        return self.dispatch_buffer_address is not None

    def next_buffer_address(self) -> int:
        """Address of the LL buffer DeepEP's next call will use (one of two)."""
        p = self.problem
        handle = (None, None, p.num_tokens, p.hidden, p.num_experts)
        return int(self.buffer.get_next_low_latency_combine_buffer(handle).data_ptr())

    def allocating(self, torch) -> contextlib.AbstractContextManager:
        """Routes torch allocations of this thread to the private pool (a no-op on the CPU)."""
        if self.pool is None:
            return contextlib.nullcontext()
        return torch.cuda.use_mem_pool(self.pool)

    def make_pool(self, torch, device: Any) -> None:
        """Creates the private pool once, for CUDA tensors only."""
        if self.pool is None and getattr(device, "type", "cpu") == "cuda":
            self.pool = torch.cuda.MemPool()

    def check(self, phase: str) -> None:
        """Raises RuntimeError unless DeepEP's next buffer is the one `phase` must use.

        Called on the host right before each DeepEP call of a capturable callback.
        """
        if phase not in PHASES:
            raise ValueError(f"{phase=} but one of {PHASES} is needed")
        if not self.is_warm:
            raise RuntimeError(
                "DeepEPLowLatency(command_buffer_compatible=True) ran a callback before its "
                "warm-up: call ll.warm_up() outside jax.jit once, before the first call"
            )
        is_dispatch_buffer = self.next_buffer_address() == self.dispatch_buffer_address
        if is_dispatch_buffer != (phase == "dispatch"):
            raise RuntimeError(
                f"DeepEP LL {phase} would be captured on the other of DeepEP's two buffers: "
                "the dispatches and combines of this adapter are no longer paired on the host "
                "(an odd number of DeepEP LL calls since the warm-up, or XLA re-captured one "
                "call of a pair without the other). Replaying it would break DeepEP's buffer "
                "alternation. Pair every dispatch with its combine in one jitted program, make "
                "LL calls outside moe_jax in pairs, or use command_buffer_compatible=False."
            )
        self.num_host_calls += 1


def combine_output(combined: jax.Array, topk_ids: jax.Array) -> jax.Array:
    """The combine's result through one select, so the DeepEP call writes an XLA temporary.

    Tokens with no valid slot are zero either way (DeepEP writes zeros there): the select changes
    no value, but XLA cannot elide it, so the captured combine never writes the program's output
    buffer, whose address may change between calls (module docstring, point 3).
    """
    has_slot = jnp.any(topk_ids >= 0, axis=1, keepdims=True)
    return jnp.where(has_slot, combined, jnp.zeros((), combined.dtype))
