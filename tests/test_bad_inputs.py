"""Bad names and inputs end in a TeccError that says what to do (the hardening issue, point 4).

One row per case: how to provoke it, the exact TeccError subclass expected, and words the
message must contain (the tensor / index / pass / file it names, and the way out)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import tecc as tc
from tecc.compiler.tuning.database import Problem, TuningDB, TuningDBLocked


def doubled(name_a: str = "A", name_b: str = "B") -> list[tc.Tensor]:
    A = tc.placeholder((4, 4), "float32", name=name_a)
    B = tc.compute((4, 4), lambda i, j: A[i, j] * 2.0, name=name_b)
    return [A, B]


def sim_kernel() -> tc.Kernel:
    return tc.build(doubled(), target="sim")


def read_only_output() -> None:
    out = np.zeros((4, 4), "float32")
    out.setflags(write=False)
    sim_kernel()(np.ones((4, 4), "float32"), out)


def build_with_plan(plan: str) -> Callable[[], Any]:
    return lambda: tc.build(doubled(), target="sim", plan=plan)


def symbolic_doubled() -> list[tc.Tensor]:
    M = tc.var("M")
    A = tc.placeholder((M,), "float32", name="A")
    return [A, tc.compute((M,), lambda i: A[i] * 2.0, name="B")]


def dump_into_a_file() -> None:
    import tempfile

    with tempfile.NamedTemporaryFile() as f:
        tc.build(doubled(), target="sim", dump_ir=f.name)


def unicode_axis() -> None:
    A = tc.placeholder((4,), "float32", name="A")
    tc.compute((4,), eval("lambda ä: A[ä] * 2.0", {"A": A}), name="B")


CASES: list[tuple[str, Callable[[], Any], type[tc.TeccError], tuple[str, ...]]] = [
    # names: they become C identifiers, file names and kernel/stage addresses
    ("tensor name with a slash", lambda: doubled("A/B"), tc.InvalidNameError, ("placeholder", "'A/B'", "'A_B'")),
    ("tensor name leading out of a directory", lambda: doubled("A", "../x"), tc.InvalidNameError,
     ("compute", "'../x'", "Rename")),
    ("non-ASCII tensor name", lambda: doubled("Ä"), tc.InvalidNameError, ("'Ä'", "ASCII")),
    ("empty tensor name", lambda: doubled(""), tc.InvalidNameError, ("placeholder", "''")),
    ("non-ASCII axis name", unicode_axis, tc.InvalidNameError, ("axis", "compute B", "'ä'")),
    ("size name with a space", lambda: tc.var("M N"), tc.InvalidNameError, ("size", "'M N'", "'M_N'")),
    ("reduce_axis name with a dot", lambda: tc.reduce_axis(4, name="k.0"), tc.InvalidNameError,
     ("reduce_axis", "'k.0'")),
    ("op name leading out of -o", lambda: tc.OpSpec("../x", doubled(), lambda a: 2 * a), tc.InvalidNameError,
     ("op name", "'../x'")),
    # arrays
    ("read-only output array", read_only_output, tc.TeccError, ("argument 1 (B)", "read-only", "writable")),
    ("output of the wrong dtype", lambda: sim_kernel()(np.ones((4, 4), "float32"), np.zeros((4, 4), "float64")),
     tc.DTypeError, ("argument 1 (B)", "float32", "float64")),
    ("output that is a list", lambda: sim_kernel()(np.ones((4, 4), "float32"), [[0.0] * 4] * 4), tc.TeccError,
     ("argument 1", "list", "NumPy arrays")),
    ("output of the wrong shape", lambda: sim_kernel()(np.ones((4, 4), "float32"), np.zeros((4, 5), "float32")),
     tc.ShapeError, ("argument 1 (B)", "dimension 1", "expected 4")),
    # plans
    ("plan that is not JSON", build_with_plan("{not json"), tc.ScheduleError, ("not valid JSON", "line 1")),
    ("plan step without a primitive", build_with_plan('{"steps": [{"args": {}}]}'), tc.ScheduleError,
     ("plan step 0", '"primitive"')),
    ("plan whose steps are not a list", build_with_plan('{"steps": 3}'), tc.ScheduleError, ("'steps'", "list")),
    ("plan that is a list", build_with_plan("[1, 2]"), tc.ScheduleError, ("JSON object", "list")),
    ("plan step with unknown arguments", build_with_plan('{"steps": [{"primitive": "split", "args": {"zzz": 1}}]}'),
     tc.ScheduleError, ("plan step split", "split takes (loop")),
    ("plan step with positional arguments", build_with_plan('{"steps": [{"primitive": "split", "args": [1]}]}'),
     tc.ScheduleError, ("plan step 0 (split)", "object of keyword arguments")),
    # build's own arguments
    ("argument that is not a tensor", lambda: tc.build([doubled()[0], 3], target="sim"), tc.TeccError,
     ("argument 1", "int", "tc.placeholder")),
    ("sizes naming no size of the program", lambda: tc.build(symbolic_doubled(), target="sim", sizes={"N": 3}),
     tc.ShapeError, ("'N'", "its sizes are M")),
    ("negative size", lambda: tc.build(symbolic_doubled(), target="sim", sizes={"M": -3}), tc.ShapeError,
     ("sizes['M']", "non-negative int")),
    ("dump directory that is a file", dump_into_a_file, tc.TeccError, ("cannot write the IR dumps", "directory")),
    # sizes
    ("shape that is None", lambda: tc.placeholder(None, "float32", name="H"), tc.DTypeError,  # type: ignore[arg-type]
     ("a shape is", "NoneType")),
    ("dimension of 2**63", lambda: tc.placeholder((2**63, 4), "float32", name="H"), tc.ShapeError,
     ("2**63", "int64")),
    ("shape of 2**63 elements", lambda: tc.placeholder((2**62, 4), "float32", name="H"), tc.ShapeError,
     ("elements", "int64")),
    ("negative dimension", lambda: tc.placeholder((-1, 4), "float32", name="H"), tc.ShapeError, ("negative", "-1")),
]


@pytest.mark.parametrize("provoke, error, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_a_tecc_error_that_says_what_to_do(provoke: Callable[[], Any], error: type[tc.TeccError],
                                                            words: tuple[str, ...]) -> None:
    with pytest.raises(tc.TeccError) as info:
        provoke()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    for word in words:
        assert word in str(info.value), f"{word!r} not in: {info.value}"


def test_from_device_without_a_gpu_raises_a_device_error() -> None:
    if tc.gpu_available():
        pytest.skip("a GPU is present")
    with pytest.raises(tc.DeviceError, match=r"from_device\(\).*tc.target\('sm_90'\)"):
        tc.target.from_device()


# ---- the tuning database and the compile cache ---------------------------------------------------

PROBLEM = Problem("sig", ((4, 4), (4, 4)), ("float32", "float32"), "sm_90", "double")


def test_corrupted_tuning_rows_name_the_table_and_the_way_out(tmp_path: Path) -> None:
    db = TuningDB(tmp_path / "tuning.sqlite")
    db.record(PROBLEM, "elementwise", {"steps": []}, [1.0, 2.0])
    with sqlite3.connect(db.path) as conn:
        conn.execute("UPDATE winners SET plan = '{broken'")
        conn.execute("UPDATE measurements SET times_us = 'nope'")
    with pytest.raises(tc.TeccError, match=r"damaged row in winners.*forget"):
        db.winner(PROBLEM)
    with pytest.raises(tc.TeccError, match=r"damaged row in measurements \(id or key 1\)"):
        db.measurements()


def test_a_locked_tuning_database_says_to_wait_and_never_to_delete(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    db = TuningDB(tmp_path / "tuning.sqlite")
    db.record(PROBLEM, "elementwise", {"steps": []}, [1.0])
    monkeypatch.setattr(TuningDB, "BUSY_TIMEOUT_S", 0.2)
    holder = sqlite3.connect(db.path, isolation_level=None)   # another process in the middle of a write
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(TuningDBLocked) as info:
            TuningDB(db.path).record(PROBLEM, "elementwise", {"steps": []}, [0.5])
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    message = str(info.value)
    assert str(db.path) in message and "wait for it" in message and "Do not delete" in message
    assert "remove it" not in message


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_tuning_database_that_is_not_a_file_says_so(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "tuning.sqlite"
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    with pytest.raises(tc.TeccError, match="is not a file.*TECC_TUNING_DB"):
        TuningDB(path).stats()


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_cache_entry_that_is_not_a_file_is_rebuilt_not_read(tmp_path: Path, kind: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A FIFO where an entry should be would block a read forever; a directory cannot be read.
    Both count as corrupt entries (docs/cache.md: corrupt entries are rebuilt, never fatal)."""
    from tecc.compiler import cache

    monkeypatch.setenv("TECC_CACHE_DIR", str(tmp_path))
    key = "ab" * 32
    path = cache.entry_path(key)
    path.parent.mkdir(parents=True)
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    before = cache.STATS.corrupt
    assert cache.lookup(key) is None
    assert cache.STATS.corrupt == before + 1


# ---- the command line ----------------------------------------------------------------------------

def tecc_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), TECC_PROGRESS="0")
    return subprocess.run([sys.executable, "-m", "tecc", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_cli_refuses_an_op_name_that_would_write_outside_the_output_directory(tmp_path: Path) -> None:
    (tmp_path / "ops.py").write_text(
        "import tecc as tc\n"
        "A = tc.placeholder((4, 4), 'float32', name='A')\n"
        "B = tc.compute((4, 4), lambda i, j: A[i, j] * 2.0, name='B')\n"
        "OPS = [tc.OpSpec('../escaped', [A, B], lambda a: 2 * a)]\n")
    out = tmp_path / "sub" / "out"
    result = tecc_cli("compile", "ops.py", "-o", str(out), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "InvalidNameError" in result.stderr and "'../escaped'" in result.stderr
    assert not list(tmp_path.rglob("escaped*"))


def test_cli_reports_an_exception_of_the_users_reference_as_the_users_error(tmp_path: Path) -> None:
    (tmp_path / "ops.py").write_text(
        "import tecc as tc\n"
        "A = tc.placeholder((4, 4), 'float32', name='A')\n"
        "B = tc.compute((4, 4), lambda i, j: A[i, j] * 2.0, name='B')\n"
        "def reference(a):\n"
        "    raise ValueError('my reference is broken')\n"
        "OPS = [tc.OpSpec('double', [A, B], reference)]\n")
    result = tecc_cli("run", "ops.py", "--target", "sim", "--check", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "ops.py raised ValueError at line 5: my reference is broken" in result.stderr
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr
