"""The DLPack bridge (moe_jax.interop.bridge) on the CPU: zero copy, jit, shard_map, dtypes.

Tests that call torch skip with the reason when it is not installed; the missing-torch error runs
either way."""

import doctest
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.interop import bridge

# Importing the bridge needs no torch; calling it does. Tests that call it take this fixture.
TORCH_REASON = "the bridge needs torch (pip install 'moe_jax[torch]')"


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch", reason=TORCH_REASON)


DTYPES = [
    jnp.float32,
    jnp.bfloat16,
    jnp.float16,
    jnp.int32,
    jnp.int8,
    jnp.uint8,
    jnp.bool_,
    jnp.float8_e4m3fn,
]


def _copy(out, x):
    out.copy_(x)


def test_writes_into_xla_buffers_without_copies(torch):
    seen = {}

    def scale(out, x):
        seen["out"], seen["x"] = out.data_ptr(), x.data_ptr()
        torch.mul(x, 3.0, out=out)

    f = jax.jit(bridge.torch_callback(scale, jax.ShapeDtypeStruct((257,), jnp.float32)))
    x = jax.random.normal(jax.random.key(0), (257,))
    y = f(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 3.0)
    assert seen["x"] == x.unsafe_buffer_pointer()  # the torch tensor is the JAX operand
    assert seen["out"] == y.unsafe_buffer_pointer()  # the result was written in place


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_every_dtype_crosses_bit_exactly(torch, dtype):
    bits = jax.random.bits(jax.random.key(1), (5, 7), jnp.uint8)
    if dtype == jnp.float8_e4m3fn:
        x = jax.lax.bitcast_convert_type(bits, dtype)  # every bit pattern, NaNs included
    elif dtype == jnp.bool_:
        x = bits > 127
    else:
        x = (jax.random.normal(jax.random.key(2), (5, 7)) * 50).astype(dtype)
    f = jax.jit(bridge.torch_callback(_copy, jax.ShapeDtypeStruct(x.shape, x.dtype)))
    y = f(x)
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(y).view(np.uint8), np.asarray(x).view(np.uint8))


def test_several_results_and_fresh_inputs_each_call(torch):
    def split(out, a, b):
        torch.add(a, b, out=out[0])
        out[1].copy_(a.to(torch.int32))

    f = jax.jit(
        bridge.torch_callback(
            split,
            (jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.int32)),
        )
    )
    for seed in range(3):
        a = jax.random.normal(jax.random.key(seed), (4,)) * 10
        b = jnp.full((4,), float(seed))
        total, ints = f(a, b)
        np.testing.assert_allclose(np.asarray(total), np.asarray(a) + seed, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(ints), np.asarray(a).astype(np.int32))


def test_composes_with_xla_ops_inside_jit(torch):
    f = bridge.torch_callback(_copy, jax.ShapeDtypeStruct((3, 4), jnp.float32))

    @jax.jit
    def g(x):
        return f(jnp.sin(x)) * 2 + 1

    x = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_allclose(
        np.asarray(g(x)), np.sin(np.arange(12.0)).reshape(3, 4) * 2 + 1, rtol=1e-6
    )


def _python_dispatch_frames(f, *args) -> list[str]:
    """The frames of JAX's Python dispatch (jit's cache miss, pjit, pxla) one call of `f` enters
    after warm-up; none when the call takes JAX's C++ fast path."""
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    frames = []

    def record(frame, event, arg):
        del arg
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if event == "call" and path.endswith(("_src/pjit.py", "interpreters/pxla.py")):
            frames.append(f"{path.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")

    sys.setprofile(record)
    try:
        out = f(*args)
    finally:
        sys.setprofile(None)
    jax.block_until_ready(out)
    return frames


def test_jitted_calls_take_jaxs_cpp_dispatch(torch):
    """A jitted function with a torch callback dispatches without Python (the callback's own
    frames aside): the buffer_callback is declared free of side effects. Declared with one, the
    executable is effectful and every call goes through pjit's Python path (60 us against 10 us
    per call here on CI's CPU, jax 0.10.2)."""
    f = jax.jit(
        lambda x: bridge.torch_callback(_copy, jax.ShapeDtypeStruct((8,), jnp.float32))(x) + 1
    )
    assert _python_dispatch_frames(f, jnp.arange(8.0)) == []


def test_the_layer_with_torch_experts_takes_jaxs_cpp_dispatch(torch):
    """The same for a whole MoE layer whose GEMMs are torch callbacks (the fast path's shape):
    per-call host work is the callbacks' only."""
    from moe_jax import fused_moe

    rng = np.random.default_rng(0)
    tokens, experts, top_k, hidden, inter = 16, 4, 2, 64, 32
    args = (
        jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((experts, 2 * inter, hidden)) * 0.1, jnp.bfloat16),
        jnp.asarray(rng.standard_normal((experts, hidden, inter)) * 0.1, jnp.bfloat16),
        jnp.asarray(rng.random((tokens, top_k)), jnp.float32),
        jnp.asarray(rng.integers(0, experts, (tokens, top_k)), jnp.int32),
    )
    layer = jax.jit(lambda *a: fused_moe(*a, experts="torch"))
    assert _python_dispatch_frames(layer, *args) == []


def test_rejects_bad_result_spec():
    with pytest.raises(TypeError, match="ShapeDtypeStruct"):
        bridge.torch_callback(_copy, [(3, 4)])
    with pytest.raises(ValueError, match="empty"):
        bridge.torch_callback(_copy, [])


def test_missing_torch_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'moe_jax\[torch\]'"):
        bridge.import_torch()
    with pytest.raises(ImportError, match=r"moe_jax\[torch\]"):
        bridge.torch_callback(_copy, jax.ShapeDtypeStruct((1,), jnp.float32))


_SHARD_MAP_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from moe_jax.interop.bridge import torch_callback

    calls = []

    def shard_fn(out, x):
        calls.append(tuple(x.shape))
        out.copy_(x * 2 + x.sum())

    f = torch_callback(shard_fn, jax.ShapeDtypeStruct((3, 4), jnp.float32))
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    x = jnp.arange(24.0).reshape(6, 4)
    y = np.asarray(g(x))
    xs = np.arange(24.0).reshape(2, 3, 4)
    want = np.concatenate([s * 2 + s.sum() for s in xs])
    print(json.dumps({"calls": calls, "ok": bool(np.allclose(y, want)), "n": len(jax.devices())}))
    """
)


def test_runs_once_per_shard_under_shard_map(torch):
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu"
    )
    done = subprocess.run(
        [sys.executable, "-c", _SHARD_MAP_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["n"] == 2
    assert sorted(map(tuple, result["calls"])) == [(3, 4), (3, 4)]
    assert result["ok"]


def test_docstring_example(torch):
    """`torch_callback`'s docstring example, which the docstring runner skips (it needs torch)."""
    parser = doctest.DocTestParser()
    examples = parser.get_examples(bridge.torch_callback.__doc__)
    for example in examples:
        example.options.clear()  # drop the +SKIP directives
    test = doctest.DocTest(examples, {"jax": jax, **vars(bridge)}, "torch_callback", None, 0, None)
    runner = doctest.DocTestRunner()
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
