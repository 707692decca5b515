"""The build cache (tecc/compiler/build_cache.py): a program planned before is built from its stored
plan and final loop IR, the same kernel as a cold build; anything that changes the plan misses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tecc as tc
from tecc.compiler import build_cache


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TECC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TECC_BUILD_CACHE", "1")
    monkeypatch.delenv("TECC_NO_CACHE", raising=False)
    monkeypatch.delenv("TECC_DUMP_IR", raising=False)
    return tmp_path


def matmul(m: int = 96, n: int = 80, k: int = 64, dtype: str = "float32") -> list[tc.Tensor]:
    A = tc.placeholder((m, k), dtype, name="A")
    B = tc.placeholder((k, n), dtype, name="B")
    r = tc.reduce_axis(k, name="k")
    C = tc.compute((m, n), lambda i, j: tc.sum(A[i, r] * B[r, j], axis=r), name="C")
    return [A, B, C]


def hit(f: tc.Kernel) -> bool:
    return any(step == "build cache hit" for step, _ in f.timing.seconds)


def entries(root: Path) -> list[Path]:
    return sorted((root / build_cache.SUBDIR).rglob("*.json"))


def test_a_second_build_comes_from_the_cache_and_is_the_same_kernel(cache_dir: Path) -> None:
    cold = tc.build(matmul(), target="sim", arch="sm_90")
    assert not hit(cold) and len(entries(cache_dir)) == 1
    warm = tc.build(matmul(), target="sim", arch="sm_90")  # new tensors: the same program
    assert hit(warm)
    assert warm.source == cold.source and str(warm.module) == str(cold.module)
    assert warm.plan.steps == cold.plan.steps and warm.plan.strategy == cold.plan.strategy
    assert "taken from the build cache" in warm.explain()
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((96, 64)).astype("float32"), rng.standard_normal((64, 80)).astype("float32")
    c = np.full((96, 80), np.nan, np.float32)
    warm.sim(a, b, c)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-4)


def test_explain_of_a_cached_build_keeps_the_planners_ranking_and_cost_breakdown(cache_dir: Path) -> None:
    cold = tc.build(matmul(), target="cuda", arch="sm_90")
    warm = tc.build(matmul(), target="cuda", arch="sm_90")
    assert hit(warm) and cold.planning is not None and warm.planning is None
    said = warm.explain()
    for part in ("chosen:", "predicted", "runners-up:", "dram", "C_kernel: grid", "ptxas:"):
        assert part in said, said
    note = [line for line in said.splitlines() if line.startswith("  (planned by an earlier build")]
    assert len(note) == 1 and "taken from the build cache" in note[0]
    assert [line for line in said.splitlines() if line not in note] == cold.explain().splitlines()


def test_a_saved_tensor_core_kernel_round_trips_through_the_cache(cache_dir: Path) -> None:
    cold = tc.build(matmul(64, 48, 32, "float16"), target="sim", arch="sm_90")
    warm = tc.build(matmul(64, 48, 32, "float16"), target="sim", arch="sm_90")
    assert cold.plan.strategy in ("gemm_tensor_core", "gemm_wgmma") and hit(warm) and warm.source == cold.source


@pytest.mark.parametrize("change", ["shape", "dtype", "arch", "sizes", "name"])
def test_what_changes_the_plan_misses(cache_dir: Path, change: str) -> None:
    tc.build(matmul(), target="sim", arch="sm_90")
    other = {
        "shape": lambda: tc.build(matmul(m=97), target="sim", arch="sm_90"),
        "dtype": lambda: tc.build(matmul(dtype="float16"), target="sim", arch="sm_90"),
        "arch": lambda: tc.build(matmul(), target="sim", arch="sm_80"),
        "sizes": lambda: tc.build(matmul(), target="sim", arch="sm_90", sizes={}),
        "name": lambda: tc.build(matmul(), target="sim", arch="sm_90", name="other"),
    }[change]()
    # sizes={} plans for the same (no symbolic) sizes: the one change that is not a change
    assert hit(other) == (change == "sizes")


def test_a_damaged_entry_is_a_miss_and_is_written_again(cache_dir: Path) -> None:
    tc.build(matmul(), target="sim", arch="sm_90")
    (entry,) = entries(cache_dir)
    entry.write_text("{not json")
    again = tc.build(matmul(), target="sim", arch="sm_90")
    assert not hit(again)
    assert '"module"' in entry.read_text()
    assert hit(tc.build(matmul(), target="sim", arch="sm_90"))


def test_dumps_explicit_plans_and_no_cache_bypass_it(cache_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    first = tc.build(matmul(), target="sim", arch="sm_90")
    dumped = tc.build(matmul(), target="sim", arch="sm_90", dump_ir=tmp_path / "dumps")
    assert not hit(dumped) and (tmp_path / "dumps" / "00_lower.txt").exists()
    assert not hit(tc.build(matmul(), target="sim", arch="sm_90", plan=first.plan))
    monkeypatch.setenv("TECC_NO_CACHE", "1")
    assert not hit(tc.build(matmul(), target="sim", arch="sm_90"))
    monkeypatch.delenv("TECC_NO_CACHE")
    monkeypatch.setenv("TECC_BUILD_CACHE", "0")
    assert not hit(tc.build(matmul(), target="sim", arch="sm_90"))


def test_the_key_follows_the_compilers_own_source(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tc.build(matmul(), target="sim", arch="sm_90")
    monkeypatch.setattr(build_cache, "_FINGERPRINT", "another compiler")
    assert not hit(tc.build(matmul(), target="sim", arch="sm_90"))
