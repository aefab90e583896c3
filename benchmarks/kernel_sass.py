"""What the Pallas kernels compile to on Hopper, without a GPU: SASS instruction counts.

For each kernel named, this lowers one call for CUDA on the machine it runs on (Pallas prints
the Triton IR of every `pallas_call` it lowers when asked to), then, where the `triton` package
is installed, compiles that IR for sm_90 with Triton's own ptxas and reads the result with its
cuobjdump: registers per thread, spills, SASS instructions per program and the most frequent
opcodes. No GPU and no CUDA install are needed: `pip install triton` brings both tools (the
CPU machines of CI run only the lowering).

Why: the fused act + quantize kernel's profile said "issue-bound"; the counts this tool gives
(2026-12-02: 1568 SASS instructions per program, of which a `div.rn.f32` sequence of 10 and a
libdevice `expf` of about 8 per element) showed which instructions to remove before any GPU time
was spent (BENCHMARKS.md, "Prefill").

    python -m benchmarks.kernel_sass [--kernels act_and_quant group_quant permute_fp8
        unpermute grouped_gemm_decode] [--top 12] [--keep DIR]

The Triton IR comes from the installed jaxlib and is compiled by the installed `triton`
package; the counts are those of that pair. XLA compiles Pallas kernels with its own copy of
Triton (inside jaxlib), whose passes can choose differently (for instance which matrix
instruction a dot becomes): treat the counts as a guide and confirm on the GPU (XLA's dumped
PTX, ncu) before acting on them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import io
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

TARGET_ARCH = 90  # sm_90: H100 / H200


@dataclasses.dataclass(frozen=True)
class TritonModule:
    """One `pallas_call`'s Triton IR as Pallas printed it, cleaned for Triton's parser."""

    name: str
    ir: str
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class SassSummary:
    name: str
    registers: int
    spills: int
    instructions: int
    opcodes: list[tuple[str, int]]


def _kernel_calls() -> dict[str, Callable[[], tuple[Callable, tuple]]]:
    """Kernel name -> a builder of (function, abstract arguments) at a layer's size: shape A's
    act*up + quantize (36832 x 4096 bf16 with expert ids) and token quantization (4096 x 7168),
    its FP8 permute, its unpermute, the routing metadata of shapes A and B, and the decode
    grouped GEMM1 of DeepSeek-V3 at T=8 and T=2048 (the latter also without
    `GroupedGemmConfig.is_fp8_wgmma`)."""
    from moe_jax import layouts
    from moe_jax import permute as moe_permute

    # The modules, not the functions `moe_jax.kernels` exports under the same names.
    act_quant = importlib.import_module("moe_jax.kernels.act_quant")
    grouped_gemm = importlib.import_module("moe_jax.kernels.grouped_gemm")
    permute = importlib.import_module("moe_jax.kernels.permute")
    routing_metadata = importlib.import_module("moe_jax.kernels.routing_metadata")
    unpermute = importlib.import_module("moe_jax.kernels.unpermute")

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype)

    def act():
        fn = lambda h, ids: act_quant.act_and_quant(h, expert_ids=ids)  # noqa: E731
        return fn, (spec((36832, 4096), jnp.bfloat16), spec((36832,), jnp.int32))

    def group():
        return act_quant.group_quant, (spec((4096, 7168), jnp.bfloat16),)

    def permute_fp8():
        def fn(x, scales, ids):
            sources = moe_permute.route(ids, num_experts=32).sources
            return permute.gather_rows(x, scales, sources)[0]

        return fn, (
            spec((4096, 7168), jnp.float8_e4m3fn),
            spec((4096, 56), jnp.float32),
            spec((4096, 8), jnp.int32),
        )

    def metadata(num_tokens, num_experts):
        """The routing metadata of T x 8 ids over E experts (alignment 128)."""
        num_rows = layouts.contiguous_num_rows(num_tokens, 8, num_experts, 128)

        def fn(ids):
            return routing_metadata.routing_metadata(
                ids, num_experts=num_experts, alignment=128, num_rows=num_rows
            )

        return lambda: (fn, (spec((num_tokens, 8), jnp.int32),))

    def unpermute_bf16():
        def fn(y, inverse, weights):
            return unpermute.unpermute(y, inverse, weights)

        return fn, (
            spec((36832, 7168), jnp.bfloat16),
            spec((4096, 8), jnp.int32),
            spec((4096, 8), jnp.float32),
        )

    def gemm(rows, alignment, *, exact=False):
        """DeepSeek-V3's GEMM1 on a contiguous layout of `rows` rows, the heuristic's config
        (FP8 wgmma), or with exact accumulation (`is_fp8_wgmma` off) when `exact`."""
        experts, n, k = 256, 4096, 7168
        config = grouped_gemm.heuristic_config(
            num_rows=rows, num_experts=experts, n=n, k=k, alignment=alignment, is_fp8=True
        )
        if exact:
            config = dataclasses.replace(config, is_fp8_wgmma=False)

        def fn(x, w, ids, xs, ws):
            return grouped_gemm.grouped_gemm_contiguous(
                x, w, ids, x_scales=xs, w_scales=ws, alignment=alignment, config=config
            )

        return lambda: (
            fn,
            (
                spec((rows, k), jnp.float8_e4m3fn),
                spec((experts, n, k), jnp.float8_e4m3fn),
                spec((rows,), jnp.int32),
                spec((rows, k // 128), jnp.float32),
                spec((experts, n // 128, k // 128), jnp.float32),
            ),
        )

    return {
        "act_and_quant": act,
        "group_quant": group,
        "permute_fp8": permute_fp8,
        "unpermute": unpermute_bf16,
        "routing_metadata_A": metadata(4096, 32),
        "routing_metadata_B": metadata(8192, 128),
        # T=8 (16-row segments), T=2048 (64-row segments), and T=2048 with the exact
        # accumulation Pallas asks for by default (mma.sync on upcast tiles)
        "grouped_gemm_decode": gemm(1024, 16),
        "grouped_gemm_2048": gemm(32512, 64),
        "grouped_gemm_2048_exact": gemm(32512, 64, exact=True),
    }


KERNELS = (
    "act_and_quant",
    "group_quant",
    "permute_fp8",
    "unpermute",
    "routing_metadata_A",
    "routing_metadata_B",
    "grouped_gemm_decode",
    "grouped_gemm_2048",
    "grouped_gemm_2048_exact",
)
_MODULE_START = re.compile(r"^module @")
_LOCATION = re.compile(r'( \[unknown\]| "[^"]*"\(#loc\d*\)| loc\([^)]*\))')


def triton_modules(fn: Callable, args: tuple) -> list[TritonModule]:
    """The Triton IR of every `pallas_call` in `jax.jit(fn)` lowered for sm_90, in call order.

    Pallas prints each module when a call asks for `debug=True`; this forces it for the duration
    of the lowering and records each call's warps and stages (Triton's compiler options, which
    the IR does not carry). Location annotations are dropped and symbol names made plain, so
    Triton's own parser reads the text.
    """
    from jax.experimental import pallas as pl

    from moe_jax.kernels import lowering

    original, options = pl.pallas_call, []

    def pallas_call_with_debug(*a, **kw):
        params = kw.get("compiler_params")
        options.append(
            (
                kw.get("name") or "kernel",
                getattr(params, "num_warps", None) or 4,
                getattr(params, "num_stages", None) or 3,
            )
        )
        return original(*a, **{**kw, "debug": True})

    pl.pallas_call = pallas_call_with_debug
    try:
        with captured_stdout() as printed:
            lowering.lower_for_hopper(fn, *args)
    finally:
        pl.pallas_call = original
    texts = _module_texts(printed.getvalue())
    if not options or len(texts) != len(options):
        raise RuntimeError(
            f"found {len(texts)} Triton modules for {len(options)} pallas_calls in the lowering "
            "output: this JAX prints its debug IR differently; update benchmarks.kernel_sass"
        )
    return [
        TritonModule(name=name, ir=text, num_warps=warps, num_stages=stages)
        for text, (name, warps, stages) in zip(texts, options, strict=True)
    ]


@contextlib.contextmanager
def captured_stdout():
    """Captures what is written to standard output, by Python and by native code (MLIR prints
    the module from C++ to file descriptor 1), into the StringIO it yields."""
    captured = io.StringIO()
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+") as sink:
        os.dup2(sink.fileno(), 1)
        try:
            with contextlib.redirect_stdout(captured):
                yield captured
            sys.stdout.flush()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            sink.seek(0)
            captured.write(sink.read())


def _module_texts(printed: str) -> list[str]:
    """Each `module @...` block of Pallas' debug print, from its first line to the closing brace
    at column 0, without locations, the kernel renamed `kernel` (Pallas names may hold '=' and
    '.', which PTX identifiers cannot)."""
    modules, current = [], None
    for line in printed.splitlines():
        if current is None and _MODULE_START.match(line):
            current = ["module @m {"]
            continue
        if current is None:
            continue
        if line.startswith("#loc"):
            continue
        line = _LOCATION.sub("", line)
        current.append(line)
        if line.rstrip() == "}":
            text = "\n".join(current) + "\n"
            modules.append(re.sub(r"tt\.func public @[^(]+\(", "tt.func public @kernel(", text))
            current = None
    return modules


def _triton_bin(tool: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    if not os.path.exists(path):
        raise RuntimeError(f"{path} is missing: this triton wheel does not bundle {tool}")
    return path


def compile_sass(module: TritonModule, workdir: str, *, top: int) -> SassSummary:
    """Compiles one module for sm_90 with the installed triton and summarizes its SASS."""
    import triton
    from triton.backends.compiler import GPUTarget

    path = os.path.join(workdir, f"{len(os.listdir(workdir))}.ttir")
    with open(path, "w") as f:
        f.write(module.ir)
    compiled = triton.compile(
        path,
        target=GPUTarget("cuda", TARGET_ARCH, 32),
        options={"num_warps": module.num_warps, "num_stages": module.num_stages},
    )
    cubin = path[: -len(".ttir")] + ".cubin"
    with open(cubin, "wb") as f:
        f.write(compiled.asm["cubin"])
    sass = subprocess.run(
        [_triton_bin("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True
    ).stdout
    opcodes = collections.Counter(
        match.group(1).split(".")[0]
        for match in re.finditer(
            r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M
        )
    )
    usage = subprocess.run(
        [_triton_bin("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True, check=True
    ).stdout
    registers = re.search(r"REG:(\d+)", usage)
    spills = re.search(r"(\d+) bytes spill stores", usage)
    return SassSummary(
        name=module.name,
        registers=int(registers.group(1)) if registers else -1,
        spills=int(spills.group(1)) if spills else 0,
        instructions=sum(opcodes.values()),
        opcodes=opcodes.most_common(top),
    )


def _print_table(args: argparse.Namespace, calls: dict, workdir: str, compiles: bool) -> None:
    """The table of `args.kernels`' modules; their IR and cubins (with triton) in `workdir`."""
    print(f"jax={jax.__version__} target=sm_{TARGET_ARCH} ir and cubins in {workdir}")
    columns = ["kernel", "pallas_call", "warps", "stages", "IR lines", "registers", "spills"]
    columns += ["SASS", "top opcodes"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for kernel in args.kernels:
        fn, fn_args = calls[kernel]()
        for module in triton_modules(fn, fn_args):
            row = f"| {kernel} | {module.name} | {module.num_warps} | {module.num_stages} | "
            row += f"{module.ir.count(chr(10))} | "
            if not compiles:
                print(row + "| | | |")
                continue
            summary = compile_sass(module, workdir, top=args.top)
            top = ", ".join(f"{op} {count}" for op, count in summary.opcodes)
            print(
                row + f"{summary.registers} | {summary.spills} | {summary.instructions} | {top} |"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    parser.add_argument("--top", type=int, default=12, help="opcodes listed per kernel")
    parser.add_argument("--keep", help="write each module's Triton IR (and cubin) here")
    args = parser.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        triton = None
        print(
            "triton is not installed: printing the lowered Triton IR sizes only "
            "(`pip install triton` to compile them for sm_90 and count SASS)",
            file=sys.stderr,
        )
    calls = _kernel_calls()
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        keep_or_temporary = contextlib.nullcontext(args.keep)
    else:  # the IR and cubins go to a folder removed on return
        keep_or_temporary = tempfile.TemporaryDirectory(prefix="kernel_sass_")
    with keep_or_temporary as workdir:
        _print_table(args, calls, workdir, triton is not None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
