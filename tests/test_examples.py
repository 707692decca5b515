"""Every op in examples/ compiles to a cubin with NVRTC and matches NumPy in the emulator (and on
the GPU where there is one): what `make run` does, as a test."""

from __future__ import annotations

from pathlib import Path

import pytest

import tecc as tc
from tecc.cli import _load_ops
from tecc.compiler.check import run_and_compare

EXAMPLES = sorted(p for p in (Path(__file__).parent.parent / "examples").glob("*.py"))
OPS = [(path, op) for path in EXAMPLES for op in _load_ops(path)]


@pytest.mark.parametrize("path,op", OPS, ids=[op.name for _, op in OPS])
def test_example_compiles_to_cubin_and_matches_numpy_in_emulator(path, op, tmp_path):
    f = tc.build(op.args, "cuda", name=op.name, dump_ir=tmp_path / "dumps")
    assert f.cubin[:4] == b"\x7fELF", f"{op.name}: NVRTC gave no ELF cubin"
    for name, res in f.resources.items():
        assert res.spill_stores == 0 and res.spill_loads == 0, f"{op.name}/{name} spills: {res}"
    result = run_and_compare(op, f, use_sim=True, seed=1)
    assert result.ok, str(result)


@pytest.mark.gpu
@pytest.mark.parametrize("path,op", OPS, ids=[op.name for _, op in OPS])
def test_example_matches_numpy_on_gpu(path, op):
    f = tc.build(op.args, "cuda", name=op.name)
    result = run_and_compare(op, f, seed=2)
    assert result.ok, str(result)
