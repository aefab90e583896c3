"""The one timing loop (`moe_jax.cli.timing`): what it calls, waits for, and reports."""

import gc
import weakref

import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.cli import timing


class Result:
    """A stand-in for an output buffer: the loop must drop the last one before the next call."""


def test_time_calls_counts_warmup_latency_and_bursts():
    calls, waits = [], []

    def call():
        calls.append(1)
        return Result()

    out = timing.time_calls(call, wait=waits.append, samples=3, burst=4, latency_samples=5)
    assert len(calls) == timing.WARMUP + 5 + 3 * 4
    assert len(waits) == timing.WARMUP + 5 + 3  # one wait per streamed sample
    assert out.streamed_ms >= 0 and out.latency_ms >= 0
    assert len(out.streamed_samples_ms) == 3
    assert out.streamed_ms == sorted(out.streamed_samples_ms)[1]  # the median of the samples


def test_time_calls_without_latency_and_previous_result_dropped():
    alive_at_call = []
    last = [None]

    def call():
        gc.collect()
        alive_at_call.append(last[0] is not None and last[0]() is not None)
        result = Result()
        last[0] = weakref.ref(result)
        return result

    out = timing.time_calls(call, wait=lambda r: None, samples=2, burst=3)
    assert out.latency_ms is None
    # The previous result is gone before the next call (its buffer can be reused).
    assert len(alive_at_call) == timing.WARMUP + 2 * 3 and not any(alive_at_call)


@pytest.mark.parametrize(
    "kwargs", [dict(samples=0), dict(samples=1, burst=0), dict(samples=1, latency_samples=-1)]
)
def test_time_calls_rejects_bad_counts(kwargs):
    with pytest.raises(ValueError, match="samples"):
        timing.time_calls(lambda: None, wait=lambda r: None, **kwargs)


def test_time_jax_returns_streamed_and_latency():
    streamed, latency = timing.time_jax(lambda a: a + 1, (jnp.ones(4),), iters=2)
    assert streamed > 0 and latency > 0


def test_rel_error_matches_numpy():
    rng = np.random.default_rng(13)
    ref = rng.standard_normal((5, 7))
    out = ref + 1e-3 * rng.standard_normal((5, 7))
    want = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    got = timing.rel_error(jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-4)
