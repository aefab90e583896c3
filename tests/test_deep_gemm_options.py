"""benchmarks/deep_gemm_options.py: its contiguous layout (moe_jax's, padded for DeepGEMM) against a
NumPy loop, its refusals off a GPU, and on the GPU host a short run of the script itself."""

from __future__ import annotations

import numpy as np
import pytest
import script_modules

from moe_jax import layouts

torch = pytest.importorskip("torch", reason="the script is torch only")


@pytest.fixture(scope="module")
def script():
    return script_modules.benchmark("deep_gemm_options")


def _expert_ids_oracle(ids: np.ndarray, num_experts: int, alignment: int) -> list[int]:
    """Row by row: each expert's valid pairs, then padding to the alignment, expert by expert."""
    rows = []
    for e in range(num_experts):
        count = int((ids == e).sum())
        rows += [e] * count + [-1] * (-count % alignment)
    return rows


@pytest.mark.parametrize("alignment", [1, 4, 64, 128])
@pytest.mark.parametrize("num_tokens", [0, 1, 37])
def test_expert_ids_are_the_padded_contiguous_layout(script, alignment, num_tokens):
    # Duplicate experts in a row, ids outside [0, E) on both sides, empty experts.
    rng = np.random.default_rng(num_tokens * 131 + alignment)
    num_experts, topk = 6, 3
    ids = rng.integers(-2, num_experts + 2, size=(num_tokens, topk)).astype(np.int32)
    got = script.contiguous_expert_ids(torch.from_numpy(ids), num_experts, alignment)
    assert got.dtype == torch.int32
    got = got.numpy()
    num_rows = layouts.contiguous_num_rows(num_tokens, topk, num_experts, alignment)
    assert got.shape[0] == -(-num_rows // 128) * 128
    want = _expert_ids_oracle(ids, num_experts, alignment)
    np.testing.assert_array_equal(got[: len(want)], want)
    assert (got[len(want) :] == -1).all()


def test_refuses_what_it_cannot_time(script, capsys):
    assert script.main(["--alignments", "32"]) == 2
    assert "64 or 128" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert script.main(["--shapes", "small"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_small_shape_runs_and_checks_every_row(script, capsys):
    pytest.importorskip("deep_gemm", reason="needs DeepGEMM (source .gpu/install.sh)")
    argv = ["--shapes", "small", "--alignments", "128", "64", "--block-n-multiples", "64"]
    assert script.main([*argv, "--pdl", "--iters", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("small GEMM1") == 2 * 2 * 2 + 1  # 2 alignments x 2 tiles x PDL, + summary
    assert "same bits True" in out
