"""One process per GPU: `jax.distributed` and `torch.distributed` started together, and a launcher.

DeepEP needs a `torch.distributed` process group (its `Buffer` exchanges IPC and NVSHMEM handles
through it) and JAX's multi-process runtime needs `jax.distributed.initialize`; both take the same
three facts, passed here as arguments (no environment variables are read):

- the coordinator's "host:port" (process 0; JAX's coordinator listens on port, torch's TCP store
  on port + 1),
- the number of processes (R, one per GPU), and
- this process's id (its EP rank; its GPU is id % GPUs per host).

Launch R local processes of a script that calls `init_distributed` with the flags
`add_arguments` defines:

    python -m moe_jax.distributed --num-processes 2 scripts/ep_multigpu.py --tokens 4096

runs `python scripts/ep_multigpu.py --tokens 4096 --coordinator-address 127.0.0.1:29500
--num-processes 2 --process-id i` for i = 0, 1 and returns the first non-zero exit status (the
other processes are then stopped). One process (R = 1) is fine: DeepEP's low-latency mode runs on
one GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

DEFAULT_COORDINATOR = "127.0.0.1:29500"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedContext:
    """What `init_distributed` started.

    Attributes:
      process_id: this process's rank.
      num_processes: R.
      local_device_id: this process's GPU on its host (None on the CPU).
      group: a gloo `torch.distributed` group over all processes (what `deep_ep.Buffer` takes;
        its object exchanges are host-side).
    """

    process_id: int
    num_processes: int
    local_device_id: int | None
    group: Any


def init_distributed(
    *,
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    local_device_id: int | None = None,
    torch_backend: str | None = None,
) -> DistributedContext:
    """Starts jax.distributed and torch.distributed for this process (one per GPU).

    Args:
      coordinator_address: "host:port" of process 0; torch's TCP store uses port + 1.
      num_processes: R, the world size.
      process_id: this process's rank in [0, R).
      local_device_id: this process's GPU; None means process_id % (GPUs on this host). Ignored
        without CUDA (CPU runs, for tests).
      torch_backend: torch.distributed's default backend; None means "nccl" with CUDA, else "gloo".

    Returns:
      `DistributedContext`. With CUDA, JAX sees only this process's GPU and torch's current
      device is the same GPU (its CUDA context exists before the first jitted call).

    Raises:
      ValueError: a malformed address or an id outside [0, R).
    """
    import torch
    import torch.distributed

    host, sep, port = coordinator_address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"{coordinator_address=}: expected 'host:port', e.g. {DEFAULT_COORDINATOR}"
        )
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"{process_id=} must be in [0, {num_processes=}) with num_processes >= 1")
    has_cuda = torch.cuda.is_available()
    local = None
    kwargs = {}
    if has_cuda:
        local = (
            process_id % torch.cuda.device_count() if local_device_id is None else local_device_id
        )
        kwargs["local_device_ids"] = [local]
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        **kwargs,
    )
    if has_cuda:
        torch.cuda.set_device(local)
        torch.zeros((), device="cuda")  # torch's CUDA context before the first jitted call
    torch.distributed.init_process_group(
        torch_backend or ("nccl" if has_cuda else "gloo"),
        init_method=f"tcp://{host}:{int(port) + 1}",
        rank=process_id,
        world_size=num_processes,
    )
    group = torch.distributed.new_group(backend="gloo")
    return DistributedContext(
        process_id=process_id, num_processes=num_processes, local_device_id=local, group=group
    )


def shutdown_distributed() -> None:
    """Ends torch.distributed and jax.distributed (call after destroying DeepEP buffers)."""
    import torch.distributed

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    jax.distributed.shutdown()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds --coordinator-address, --num-processes and --process-id (what `launch` passes)."""
    parser.add_argument("--coordinator-address", default=DEFAULT_COORDINATOR)
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)


def init_from_args(args: argparse.Namespace, **kwargs: Any) -> DistributedContext:
    """`init_distributed` with the flags of `add_arguments`."""
    return init_distributed(
        coordinator_address=args.coordinator_address,
        num_processes=args.num_processes,
        process_id=args.process_id,
        **kwargs,
    )


def launch(
    command: Sequence[str],
    *,
    num_processes: int,
    coordinator_address: str = DEFAULT_COORDINATOR,
    timeout_s: float | None = None,
) -> int:
    """Runs `python <command> --coordinator-address A --num-processes R --process-id i` for each
    i in [0, R) on this host and waits for all of them.

    Returns:
      0 when every process exits 0; else the first failure's exit status (the others are then
      terminated), or 124 after `timeout_s`.
    """
    if num_processes < 1:
        raise ValueError(f"{num_processes=} must be >= 1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                *command,
                "--coordinator-address",
                coordinator_address,
                "--num-processes",
                str(num_processes),
                "--process-id",
                str(i),
            ]
        )
        for i in range(num_processes)
    ]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    status = 0
    while status == 0:
        codes = [p.poll() for p in procs]  # poll every process (no short-circuit)
        if all(code is not None for code in codes):
            break
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            status = failed[0]
        elif deadline is not None and time.monotonic() > deadline:
            status = 124
        else:
            time.sleep(0.1)
    for p in procs:  # stop the processes this call started that still run
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    if status == 0:
        status = next((p.returncode for p in procs if p.returncode), 0)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_jax.distributed",
        description="Run one process per GPU of a script that calls moe_jax.distributed."
        "init_from_args (see the module docstring).",
    )
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--coordinator-address", default=DEFAULT_COORDINATOR)
    parser.add_argument("--timeout-s", type=float, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="script.py [its arguments]")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give the script to run, e.g. scripts/ep_multigpu.py")
    return launch(
        args.command,
        num_processes=args.num_processes,
        coordinator_address=args.coordinator_address,
        timeout_s=args.timeout_s,
    )


if __name__ == "__main__":
    sys.exit(main())
