"""The tokamax bench peer (`moe_jax.cli.tokamax_peer`): its layer against the float64 oracles, its
skip reasons, and its rows in `bench`, `bench --train` and `bench --decode` on the CPU."""

import importlib.util
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest

from moe_jax.cli import decode_bench, layer_bench, layer_report, tokamax_peer, train_bench

HAS_TOKAMAX = importlib.util.find_spec("tokamax") is not None
PEERS = list(tokamax_peer.PEERS)
# relative Frobenius error against the oracle with the same rounding points (bf16: GEMM outputs
# and act * up rounded to bf16, as both do; the difference is accumulation order)
TOL = {"float32": 1e-5, "bfloat16": 1e-2}
T, E, K, H, I = 24, 6, 2, 64, 32  # noqa: E741 - DESIGN.md's names; ids leave expert 5 empty


def _lax(rows, w, sizes):  # jax.lax.ragged_dot on [E, K, N] weights, as tokamax takes them
    return jax.lax.ragged_dot(rows, w, sizes, preferred_element_type=rows.dtype)


IMPLS = {
    "lax": lambda *a: tokamax_peer.sorted_moe(*a, ragged_dot=_lax),
    "tokamax": lambda *a: tokamax_peer.peer_layer("tokamax")(*a),  # its XLA fallback on a CPU
}
PARAMS = [
    pytest.param("lax"),
    pytest.param("tokamax", marks=pytest.mark.skipif(not HAS_TOKAMAX, reason="needs tokamax")),
]


def _inputs(dtype: str) -> oracles.MoeInputs:
    """Ids in [0, E - 1) (duplicates in a row included), negative router weights too."""
    rng = np.random.default_rng(oracles.seed("tokamax_peer", dtype))
    return oracles.moe_inputs((T, H, I, E, K), dtype, rng, id_high=E - 1)


@pytest.mark.parametrize("impl", PARAMS)
@pytest.mark.parametrize("dtype", list(TOL))
def test_peer_layer_matches_the_oracle(impl, dtype):
    m = _inputs(dtype)
    x, w1, w2, weights, ids = m.args()
    got = jax.jit(IMPLS[impl])(x, *tokamax_peer.to_kn(w1, w2), weights, ids)
    assert got.dtype == x.dtype and got.shape == (T, H)
    want = oracles.fused_moe(m.x, m.w1, m.w2, m.topk_weights, m.topk_ids)
    oracles.assert_grad_close("out", got, want, TOL[dtype])  # one array's relative error


@pytest.mark.parametrize("impl", PARAMS)
def test_peer_gradients_match_float64(impl):
    """jax.grad through the peer (tokamax's own VJP for "tokamax") against the float64 oracle's;
    the weight gradients come back in tokamax's [E, K, N] layout."""
    m = _inputs("float32")
    x, w1, w2, weights, ids = m.args()
    probe = np.random.default_rng(1).normal(size=(T, H))

    def loss(x, w1t, w2t, weights):
        return jnp.sum(IMPLS[impl](x, w1t, w2t, weights, ids) * jnp.asarray(probe, jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    dx, dw1, dw2, dtw = grad(x, *tokamax_peer.to_kn(w1, w2), weights)
    want = oracles.fused_moe_grads(m.x, m.w1, m.w2, m.topk_weights, probe, m.topk_ids)
    oracles.assert_grads_close((dx, *tokamax_peer.to_kn(dw1, dw2), dtw), want, TOL["float32"])


def test_skip_reasons(monkeypatch):
    if HAS_TOKAMAX:
        assert tokamax_peer.unavailable_reason("tokamax") is None  # its XLA fallback runs anywhere
        want = None if jax.default_backend() == "gpu" else "needs an NVIDIA GPU"
        assert [tokamax_peer.unavailable_reason(n) for n in PEERS[1:]] == [want] * 2
    monkeypatch.setitem(sys.modules, "tokamax", None)  # `import tokamax` raises
    rows = layer_bench.run(["small"], PEERS, iters=1)
    assert [r["skipped"] for r in rows] == [tokamax_peer.unavailable_reason("tokamax")] * 3
    assert rows[0]["skipped"].startswith("needs the peers extra: pip install -e '.[peers]'")
    notes = [line for line in layer_report.format_table(rows).splitlines() if line[:1] == "["]
    assert len(notes) == 1  # the reason once, below the table


def test_best_tokamax_row_is_a_baseline():
    times = {"jax_mosaic_bf16": 4.0, "tokamax_triton": 2.0, "tokamax": 3.0, "moe_jax_bf16": 1.0}
    rows = [dict(shape="B", variant=name, ms=ms) for name, ms in times.items()]
    layer_bench._add_ratios(rows)
    assert [r["vs_best_baseline"] for r in rows] == [0.5, 1.0, 2 / 3, 2.0]


def _check_rows(rows: dict, error_key: str, tol: float):
    """The three peer rows: run and checked where they can, else the reason."""
    for name in PEERS:
        row = rows[name]
        if not HAS_TOKAMAX:
            assert row["skipped"].startswith("needs the peers extra"), row
        elif name != "tokamax" and jax.default_backend() != "gpu":
            assert row["skipped"] == "needs an NVIDIA GPU", row
        else:
            errors = [row[k] for k in row if k.startswith(error_key)]
            assert "skipped" not in row and errors and max(errors) < tol, row


@pytest.mark.slow
def test_peer_rows_in_the_benches(tmp_path, capsys):
    rows = layer_bench.run(["small"], PEERS, iters=1)
    _check_rows({r["variant"]: r for r in rows}, "rel_err", 0.02)
    rows = train_bench.run("small", PEERS, iters=1)
    _check_rows({r["variant"]: r for r in rows}, "err_d", 0.02)
    assert train_bench.format_table(rows).count("needs ") <= 1  # one reason, printed once
    path, variants = tmp_path / "d.json", [*PEERS, "auto_bf16"]  # bf16 weights, dequantized
    status = decode_bench.run_decode_bench(
        tokens=[2], iters=1, json_path=str(path), shape="tiny", variants=variants
    )
    assert status == 0
    (row,) = json.loads(path.read_text())["rows"]
    _check_rows(row["variants"], "rel_error", 0.02)
    assert row["variants"]["auto_bf16"]["rel_error"] < 0.02
    table = capsys.readouterr().out
    assert "| tokamax us | tokamax_mosaic us | tokamax_triton us |" in table
    assert table.count("needs ") <= 1
