"""`python -m benchmarks.kernel_sass` on the CPU: every kernel lowers for CUDA and yields one
Triton module per pallas_call, cleaned for Triton's parser; with the `triton` package installed
(not in CI) the modules also compile for sm_90 and the SASS is summarized."""

from __future__ import annotations

import importlib.util
import tempfile

import pytest
import script_modules

kernel_sass = script_modules.benchmark("kernel_sass")


@pytest.mark.parametrize("kernel", kernel_sass.KERNELS)
def test_each_kernel_lowers_to_clean_triton_modules(kernel):
    fn, args = kernel_sass._kernel_calls()[kernel]()
    modules = kernel_sass.triton_modules(fn, args)
    assert len(modules) >= 1
    for module in modules:
        assert module.ir.startswith("module @m {\n") and module.ir.rstrip().endswith("}")
        assert "tt.func public @kernel(" in module.ir
        assert "[unknown]" not in module.ir and "loc(" not in module.ir and "#loc" not in module.ir
        assert module.num_warps in (1, 2, 4, 8, 16) and module.num_stages >= 1


def test_kernels_lists_every_builder():
    assert kernel_sass.KERNELS == tuple(kernel_sass._kernel_calls())


def test_main_prints_a_row_per_pallas_call_and_removes_its_work_folder(
    capsys, monkeypatch, tmp_path
):
    """Without --keep the IR and cubins go to a temporary folder that is gone on return; with
    --keep DIR the folder stays."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert kernel_sass.main(["--kernels", "group_quant", "act_and_quant"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| kernel | pallas_call |")
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| group_quant", "| act_and_quant"]
    assert f"in {tmp_path}/kernel_sass_" in out and not list(tmp_path.iterdir())
    kept = tmp_path / "kept"
    assert kernel_sass.main(["--kernels", "group_quant", "--keep", str(kept)]) == 0
    assert f"in {kept}" in capsys.readouterr().out and kept.is_dir()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_modules_compile_for_sm90(tmp_path):
    fn, args = kernel_sass._kernel_calls()["group_quant"]()
    [module] = kernel_sass.triton_modules(fn, args)
    summary = kernel_sass.compile_sass(module, str(tmp_path), top=5)
    assert summary.registers > 0 and summary.instructions > 100 and summary.spills == 0
    assert len(summary.opcodes) == 5
