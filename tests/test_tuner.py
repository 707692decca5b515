"""The measured autotuner (the package tecc/compiler/tuning/: tuner.py and its steps): candidates, the
process-pool compile, reuse of the tuning database, rejection of wrong candidates, and the errors
without a GPU."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tecc as tc
from tecc.compiler import tuning as tuner
from tecc.compiler import build
from tecc.compiler.planner import plan_program
from tecc.compiler.tuning import TuningDB
from tecc.ir.errors import TeccError

ROOT = Path(__file__).resolve().parent.parent
MATMUL_FILE = ROOT / "examples" / "matmul.py"


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TECC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TECC_TUNING_DB", str(tmp_path / "tuning.sqlite"))
    monkeypatch.delenv("TECC_ARCH", raising=False)


def small_matmul(m: int = 8, n: int = 16, k: int = 8) -> tc.OpSpec:
    """A matmul small enough for the emulator, with a symbolic M."""
    M = tc.var("M")
    A = tc.placeholder((M, k), "float32", name="A")
    B = tc.placeholder((k, n), "float32", name="B")
    r = tc.reduce_axis(k, name="k")
    C = tc.compute((M, n), lambda i, j: tc.sum(A[i, r] * B[r, j], axis=r), name="C")
    return tc.OpSpec("small_matmul", [A, B, C], lambda a, b: a @ b, sizes={"M": m})


def _no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tecc.runtime.cuda.cuda_unavailable_reason", lambda: "no device (test)")


class SimBench(tuner.Bench):
    """Runs candidates in the emulator; `wrong` plans get their output corrupted, and the fake
    times make the wrong one look fastest, so only the check can keep it from winning."""

    device = "emulator"

    def __init__(self, wrong: tc.Plan | None = None) -> None:
        self.wrong = wrong
        self.timed: list[str] = []

    def _is_wrong(self, kernel: Any) -> bool:
        return self.wrong is not None and kernel.plan.steps == self.wrong.steps

    def run(self, kernel: Any, arrays: list[np.ndarray]) -> None:
        kernel.sim(*arrays)
        if self._is_wrong(kernel):
            arrays[-1][0, 0] += 1.0

    def time(self, kernel: Any, arrays: list[np.ndarray], warmup: int, repeats: int) -> list[float]:
        self.timed.append(kernel.plan.strategy)
        base = 1.0 if self._is_wrong(kernel) else 10.0 + len(self.timed)
        return [base + 0.1 * i for i in range(repeats)]


# ---- candidates -------------------------------------------------------------------------------

def test_candidates_start_with_the_planners_plan_then_rank_by_predicted_time() -> None:
    spec = tuner.load_op(MATMUL_FILE, "matmul")
    planned = plan_program(spec.args, "sm_90", sizes=spec.sizes, name="matmul")
    _, cands = tuner.candidate_plans(spec.args, "sm_90", sizes=spec.sizes, name="matmul", top_k=4)
    assert 2 <= len(cands) <= 4
    assert cands[0].plan.steps == planned.plan.steps, "the first candidate is the planner's choice"
    rest = [c.predicted_us for c in cands[1:]]
    assert rest == sorted(rest) and all(c.predicted_us > 0 for c in cands)
    assert len({c.plan.to_json() for c in cands}) == len(cands), "candidates are distinct plans"
    assert all(c.strategy == c.plan.strategy and c.label for c in cands)


def test_top_k_must_be_positive() -> None:
    spec = small_matmul()
    with pytest.raises(TeccError, match="top_k"):
        tuner.candidate_plans(spec.args, "sm_90", sizes=spec.sizes, top_k=0)


def test_concrete_shapes_name_the_missing_size() -> None:
    spec = small_matmul()
    assert tuner.concrete_shapes(spec.args, {"M": 4}) == [(4, 8), (8, 16), (4, 16)]
    with pytest.raises(TeccError, match="size of M"):
        tuner.concrete_shapes(spec.args, {})


def test_each_step_lives_in_its_module_and_every_public_name_is_importable_from_the_package() -> None:
    from tecc.compiler.tuning import bench, candidates, check, database, pool

    assert tuner.candidate_plans is candidates.candidate_plans
    assert tuner.compile_candidates is pool.compile_candidates and tuner.ProgramRef is pool.ProgramRef
    assert tuner.CudaBench is bench.CudaBench and issubclass(tuner.CudaBench, tuner.Bench)
    assert tuner.TuningDB is database.TuningDB and tuner.Reference is check.Reference
    assert all(hasattr(tuner, name) for name in tuner.__all__)


def test_build_reaches_the_tuner_through_tuned_plan_and_the_tuner_never_imports_build() -> None:
    import ast
    from pathlib import Path as P

    package = P(tuner.__file__).parent
    for module in package.glob("*.py"):
        tree = ast.parse(module.read_text())
        imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "build" not in {m.rsplit(".", 1)[-1] for m in imported}, f"{module.name} imports build"


# ---- the process pool -------------------------------------------------------------------------

def test_process_pool_compiles_each_candidate_with_nvrtc_in_worker_processes() -> None:
    spec = tuner.load_op(MATMUL_FILE, "matmul")
    _, cands = tuner.candidate_plans(spec.args, "sm_90", sizes=spec.sizes, name="matmul", top_k=3)
    plans = [c.plan for c in cands[:2]] + [tc.default_plan()]
    outcomes = tuner.compile_candidates(plans, "sm_90", ref=tuner.ProgramRef(str(MATMUL_FILE), "matmul"),
                                        name="matmul", workers=2)
    assert len(outcomes) == 3
    for plan, out in zip(plans, outcomes):
        assert out.error is None, f"{plan.strategy}: {out.error}"
        assert out.code.cubin and out.code.arch == "sm_90" and out.pid != os.getpid()
        # the worker rebuilt the tensors from the file: its source is the one this process emits
        local = build(spec.args, "sim", name="matmul", plan=plan)
        assert out.source_sha256 == hashlib.sha256(local.source.encode()).hexdigest()


def test_in_memory_programs_send_their_cuda_source_to_the_workers() -> None:
    spec = small_matmul()
    kernel = build(spec.args, "sim", plan=tc.default_plan())
    [out] = tuner.compile_candidates([kernel.plan], "sm_90", sources=[(kernel.name, kernel.source)], workers=0)
    assert out.error is None and out.code.cubin and out.pid == os.getpid()


def test_a_candidate_that_does_not_compile_is_reported_not_raised() -> None:
    [out] = tuner.compile_candidates([tc.default_plan()], "sm_90", sources=[("bad", "this is not CUDA")], workers=0)
    assert out.code is None and "Error" in (out.error or "")


# ---- the tuning database ----------------------------------------------------------------------

def test_build_tune_replays_the_database_winner_without_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch)
    spec = small_matmul()
    _, cands = tuner.candidate_plans(spec.args, "sm_90", sizes=spec.sizes, top_k=3)
    stored = cands[-1].plan  # not the planner's first choice, so replaying it is visible
    problem = tuner.problem_of(spec.args, spec.sizes, "sm_90", None)
    TuningDB().record(problem, stored.strategy, stored, [4.0, 5.0, 6.0], predicted_us=3.0)

    def must_not_measure(*a: Any, **k: Any) -> Any:
        raise AssertionError("the tuner measured although the database has a winner")

    monkeypatch.setattr(tuner, "tune", must_not_measure)
    monkeypatch.setattr(tuner.CudaBench, "time", must_not_measure)
    monkeypatch.setattr(tuner.CudaBench, "__init__", must_not_measure)

    f = build(spec.args, "sim", sizes=dict(spec.sizes), tune=True)
    assert f.plan.steps == stored.steps and f.plan.strategy == stored.strategy
    assert f.plan.reason.startswith(tuner.REASON_FROM_DB) and "median 5.0 us" in f.plan.reason
    a, b = np.ones((8, 8), np.float32), np.ones((8, 16), np.float32)
    c = np.zeros((8, 16), np.float32)
    f.sim(a, b, c)
    np.testing.assert_allclose(c, a @ b)

    # another shape is another problem: nothing stored, and no GPU to measure on
    monkeypatch.undo()
    _no_gpu(monkeypatch)
    with pytest.raises(TeccError, match="tuning needs a CUDA device"):
        build(spec.args, "sim", sizes={"M": 9}, tune=True)


def test_a_winner_is_replayed_only_under_the_precise_math_setting_it_was_measured_with(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch)
    monkeypatch.delenv("TECC_PRECISE_MATH", raising=False)
    spec = small_matmul()
    _, cands = tuner.candidate_plans(spec.args, "sm_90", sizes=spec.sizes, top_k=3)
    stored = cands[-1].plan
    cheap = tuner.problem_of(spec.args, spec.sizes, "sm_90", None)
    assert not cheap.precise_math
    TuningDB().record(cheap, stored.strategy, stored, [5.0])
    assert build(spec.args, "sim", sizes=dict(spec.sizes), tune=True, arch="sm_90").plan.steps == stored.steps

    # the same op built with precise sin/cos is another problem: nothing stored, no GPU to measure on
    monkeypatch.setenv("TECC_PRECISE_MATH", "1")
    precise = tuner.problem_of(spec.args, spec.sizes, "sm_90", None)
    assert precise.precise_math and precise.key != cheap.key
    with pytest.raises(TeccError, match="tuning needs a CUDA device"):
        build(spec.args, "sim", sizes=dict(spec.sizes), tune=True, arch="sm_90")
    TuningDB().record(precise, cands[0].plan.strategy, cands[0].plan, [6.0])
    f = build(spec.args, "sim", sizes=dict(spec.sizes), tune=True, arch="sm_90")
    assert f.plan.steps == cands[0].plan.steps and "median 6.0 us" in f.plan.reason


# ---- checking the candidates ------------------------------------------------------------------

def test_a_wrong_candidate_is_rejected_and_never_wins(tmp_path: Path) -> None:
    spec = small_matmul()
    _, cands = tuner.candidate_plans(spec.args, "sm_90", sizes=spec.sizes, top_k=3)
    wrong = cands[0].plan
    bench = SimBench(wrong=wrong)
    db = TuningDB(tmp_path / "t.sqlite")
    result = tuner.tune(spec, arch="sm_90", top_k=3, bench=bench, db=db, workers=0, repeats=5)

    [bad] = [r for r in result.results if r.candidate.plan.steps == wrong.steps]
    assert not bad.ok and bad.error is not None and bad.error.startswith("wrong result: C rel err")
    assert bad.times_us == [], "a wrong candidate is not timed"
    assert result.plan.steps != wrong.steps and result.plan.reason.startswith(tuner.REASON_MEASURED)
    good = [r for r in result.results if r.ok]
    assert good and all(r.rel_error is not None and r.rel_error < 1e-5 for r in good)
    assert result.winner is not None and result.winner.median_us == min(r.median_us for r in good)

    # everything was stored, the wrong one as not ok; the winner is the measured winner
    rows = db.measurements(result.problem)
    assert len(rows) == len(result.results)
    assert [m.ok for m in rows if m.plan["steps"] == [s.to_json() for s in wrong.steps]] == [False]
    assert all(m.predicted_us is not None for m in rows)
    stored = db.winner(result.problem)
    assert stored is not None and tc.Plan.from_json(stored.plan).steps == result.plan.steps
    assert "wrong result" in result.table() and "* " in result.table()


def test_without_a_reference_the_naive_plans_result_is_the_reference(tmp_path: Path) -> None:
    spec = small_matmul()
    _, cands = tuner.candidate_plans(spec.args, "sm_90", sizes=spec.sizes, top_k=2)
    bench = SimBench(wrong=cands[0].plan)
    result = tuner.tune(list(spec.args), sizes=dict(spec.sizes), arch="sm_90", top_k=2, bench=bench,
                        db=TuningDB(tmp_path / "t.sqlite"), workers=0, repeats=3)
    assert [r.ok for r in result.results] == [False, True]
    assert result.results[0].error is not None and "wrong result" in result.results[0].error


# ---- no GPU -----------------------------------------------------------------------------------

def test_tuning_without_a_gpu_says_it_needs_one_and_that_auto_works(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch)
    spec = small_matmul()
    with pytest.raises(TeccError, match="tuning needs a CUDA device") as info:
        tuner.tune(spec)
    assert 'plan="auto"' in str(info.value)
    with pytest.raises(TeccError, match="tuning needs a CUDA device"):
        build(spec.args, "cuda", sizes=dict(spec.sizes), tune=True, arch="sm_90")
    # plan="auto" still builds
    assert build(spec.args, "cuda", arch="sm_90").plan.strategy


# ---- on the GPU -------------------------------------------------------------------------------

@pytest.mark.gpu
def test_tune_a_matmul_on_the_gpu_then_reuse_it(capsys: pytest.CaptureFixture[str]) -> None:
    spec = tuner.load_op(MATMUL_FILE, "matmul")
    result = tuner.tune(spec, top_k=4, ref=tuner.ProgramRef(str(MATMUL_FILE), "matmul"), workers=2)
    with capsys.disabled():
        print(f"\n{result.device}: {result.note}; {result.seconds:.1f} s\n{result.table()}")
    assert result.winner is not None and all(r.ok for r in result.results), result.table()
    assert all(t > 0 for r in result.results for t in r.times_us)
    db = TuningDB()
    assert len(db.measurements(result.problem)) == len(result.results)

    f = build(spec.args, "cuda", name="matmul", sizes=dict(spec.sizes), tune=True)
    assert f.plan.steps == result.plan.steps and f.plan.reason.startswith(tuner.REASON_FROM_DB)
    a = np.random.default_rng(0).uniform(-1, 1, (100, 256)).astype(np.float32)
    b = np.random.default_rng(1).uniform(-1, 1, (256, 512)).astype(np.float32)
    c = np.zeros((100, 512), np.float32)
    f(a, b, c)
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
