"""The SQLite tuning database (tecc/compiler/tuning/database.py)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

import tecc as tc
from tecc.compiler.tuning.database import Problem, TuningDB, op_signature
from tecc.ir.errors import TeccError


def _matmul(n: int = 512):
    M = tc.var("M")
    A = tc.placeholder((M, 256), "float32", name="A")
    B = tc.placeholder((256, n), "float32", name="B")
    k = tc.reduce_axis(256, name="k")
    C = tc.compute((M, n), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    return [A, B, C]


def _problem(m: int = 100, arch: str = "sm_90") -> Problem:
    return Problem.of(_matmul(), [(m, 256), (256, 512), (m, 512)], arch, "matmul")


def test_signature_is_stable_and_distinguishes_ops() -> None:
    assert op_signature(_matmul()) == op_signature(_matmul())
    assert op_signature(_matmul()) != op_signature(_matmul(256))
    p = _problem()
    assert p.dtypes == ("float32",) * 3 and p.shapes[0] == (100, 256)
    assert p.key != _problem(200).key and p.key != _problem(arch="sm_80").key


def test_winner_is_the_fastest_correct_measurement(tmp_path: Path) -> None:
    db = TuningDB(tmp_path / "t.sqlite")
    p = _problem()
    assert db.winner(p) is None
    db.record(p, "naive", {"steps": ["a"]}, [30.0, 20.0, 25.0], predicted_us=22.0, device="H100")
    db.record(p, "tiled", {"steps": ["b"]}, [9.0, 11.0, 10.0], predicted_us=8.0)
    db.record(p, "broken", {"steps": ["c"]}, [1.0], ok=False)               # wrong answer: never wins
    db.record(p, "crashed", {"steps": ["d"]}, [], error="LaunchError: ...")  # no time: never wins
    db.record(p, "slower", {"steps": ["e"]}, [50.0])
    w = db.winner(p)
    assert w is not None and w.strategy == "tiled" and w.plan == {"steps": ["b"]} and w.median_us == 10.0
    assert db.winner(_problem(200)) is None
    ms = db.measurements(p)
    assert [m.strategy for m in ms] == ["naive", "tiled", "broken", "crashed", "slower"]
    assert ms[0].median_us == 25.0 and ms[0].times_us == [30.0, 20.0, 25.0] and ms[0].device == "H100"
    assert not ms[2].ok and not ms[3].ok and ms[3].error.startswith("LaunchError")
    assert set(db.best_per_strategy(p)) == {"naive", "tiled", "slower"}
    report = db.report(p)
    assert [(r["strategy"], r["predicted_us"], r["measured_us"]) for r in report] == [("naive", 22.0, 25.0),
                                                                                      ("tiled", 8.0, 10.0)]
    assert report[1]["ratio"] == pytest.approx(1.25)
    assert db.stats() == {"measurements": 5, "problems": 1}


def test_record_many_and_forget(tmp_path: Path) -> None:
    db = TuningDB(tmp_path / "t.sqlite")
    p, q = _problem(), _problem(64)
    ids = db.record_many(p, [{"strategy": "a", "plan": {"x": 1}, "times_us": [3.0]},
                             {"strategy": "b", "plan": '{"x": 2}', "times_us": [2.0], "predicted_us": 1.5}])
    db.record(q, "a", {"x": 1}, [1.0])
    assert len(ids) == 2 and db.winner(p).plan == {"x": 2}  # type: ignore[union-attr]
    assert db.forget(p) == 2
    assert db.winner(p) is None and db.winner(q) is not None
    db.forget()
    assert db.stats() == {"measurements": 0, "problems": 0}


def test_default_path_follows_the_knobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TECC_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv("TECC_TUNING_DB", raising=False)
    assert TuningDB().path == tmp_path / "c" / "tuning.sqlite"
    monkeypatch.setenv("TECC_TUNING_DB", str(tmp_path / "elsewhere.db"))
    assert TuningDB().path == tmp_path / "elsewhere.db"


def test_newer_schema_and_garbage_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "new.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version=99")
    with pytest.raises(TeccError, match="newer than this"):
        TuningDB(path).stats()
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(TeccError, match="unusable"):
        TuningDB(junk).stats()


_WRITER = """
import sys
from tecc.compiler.tuning.database import Problem, TuningDB
db = TuningDB(sys.argv[1])
p = Problem("sig", ((100, 256),), ("float32",), "sm_90", "op")
w = int(sys.argv[2])
for i in range(25):
    db.record(p, f"s{w}", {"w": w, "i": i}, [1000.0 - 10 * w - i])
"""


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "shared.sqlite"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(w)], stderr=subprocess.PIPE, text=True)
             for w in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    db = TuningDB(path)
    assert db.stats() == {"measurements": 100, "problems": 1}
    w = db.winner(Problem("sig", ((100, 256),), ("float32",), "sm_90"))
    assert w is not None and w.median_us == 1000.0 - 30 - 24 and w.plan == {"w": 3, "i": 24}


# ---- precise math is part of the key ------------------------------------------------------------

def test_precise_math_is_part_of_the_problem_and_follows_the_knob(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """TECC_PRECISE_MATH changes the emitted math of 16-bit sin/cos, hence the times: a winner
    measured with it on is not the winner without it, and both are kept."""
    monkeypatch.delenv("TECC_PRECISE_MATH", raising=False)
    cheap = _problem()
    monkeypatch.setenv("TECC_PRECISE_MATH", "1")
    precise = _problem()
    assert not cheap.precise_math and precise.precise_math
    assert cheap.key != precise.key and cheap.key[:4] == precise.key[:4]
    assert Problem.of(_matmul(), [(100, 256), (256, 512), (100, 512)], "sm_90", "matmul",
                      precise_math=False) == cheap

    db = TuningDB(tmp_path / "t.sqlite")
    db.record(cheap, "cheap", {"steps": ["a"]}, [10.0], predicted_us=8.0)
    assert db.winner(precise) is None, "a winner measured with the cheap sin/cos answered a precise-math build"
    db.record(precise, "precise", {"steps": ["b"]}, [20.0], predicted_us=8.0)
    assert db.winner(cheap).strategy == "cheap" and db.winner(precise).strategy == "precise"  # type: ignore[union-attr]
    assert [m.precise_math for m in db.measurements()] == [False, True]
    assert [m.strategy for m in db.measurements(precise)] == ["precise"]
    assert [r["precise_math"] for r in db.report()] == [False, True]
    assert db.forget(cheap) == 1 and db.winner(precise) is not None
    assert db.stats() == {"measurements": 1, "problems": 1}


# Schema version 1, as tecc wrote it before precise_math was part of the key.
_SCHEMA_1 = """
CREATE TABLE measurements (
    id INTEGER PRIMARY KEY AUTOINCREMENT, op_signature TEXT NOT NULL, op_name TEXT NOT NULL DEFAULT '',
    shapes TEXT NOT NULL, dtypes TEXT NOT NULL, arch TEXT NOT NULL, strategy TEXT NOT NULL, plan TEXT NOT NULL,
    plan_hash TEXT NOT NULL, median_us REAL, times_us TEXT NOT NULL DEFAULT '[]', predicted_us REAL,
    ok INTEGER NOT NULL DEFAULT 1, error TEXT, device TEXT NOT NULL DEFAULT '',
    tecc_version TEXT NOT NULL DEFAULT '', created REAL NOT NULL);
CREATE INDEX measurements_key ON measurements (op_signature, shapes, dtypes, arch, strategy);
CREATE TABLE winners (
    op_signature TEXT NOT NULL, shapes TEXT NOT NULL, dtypes TEXT NOT NULL, arch TEXT NOT NULL,
    strategy TEXT NOT NULL, plan TEXT NOT NULL, median_us REAL NOT NULL,
    measurement_id INTEGER REFERENCES measurements (id), updated REAL NOT NULL,
    PRIMARY KEY (op_signature, shapes, dtypes, arch));
PRAGMA user_version=1;
"""


def test_a_version_1_database_is_read_with_precise_math_off(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    old = Problem("sig", ((100, 256),), ("float32",), "sm_90", "op")
    sig, shapes, dtypes, arch, _ = old.key
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.executescript(_SCHEMA_1)
        conn.execute("INSERT INTO measurements (op_signature, op_name, shapes, dtypes, arch, strategy, plan, plan_hash, "
                     "median_us, times_us, predicted_us, ok, device, tecc_version, created) "
                     "VALUES (?, 'op', ?, ?, ?, 'tiled', '{\"x\":1}', 'h', 7.0, '[7.0]', 6.0, 1, 'H200', '0.1.0', 0)",
                     (sig, shapes, dtypes, arch))
        conn.execute("INSERT INTO winners VALUES (?, ?, ?, ?, 'tiled', '{\"x\":1}', 7.0, 1, 0)", (sig, shapes, dtypes, arch))

    db = TuningDB(path)
    w = db.winner(old)
    assert w is not None and w.strategy == "tiled" and w.plan == {"x": 1} and w.median_us == 7.0
    assert db.winner(Problem("sig", ((100, 256),), ("float32",), "sm_90", "op", precise_math=True)) is None
    [m] = db.measurements(old)
    assert m.precise_math is False and m.median_us == 7.0 and m.device == "H200"
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
    # the migrated file takes new measurements under both keys; a faster one still replaces the winner
    db.record(old, "faster", {"x": 2}, [5.0])
    db.record(Problem("sig", ((100, 256),), ("float32",), "sm_90", "op", precise_math=True), "precise", {"x": 3}, [9.0])
    assert db.winner(old).strategy == "faster"  # type: ignore[union-attr]
    assert db.stats() == {"measurements": 3, "problems": 2}
    assert TuningDB(path).winner(old).strategy == "faster", "a second open does not migrate again"  # type: ignore[union-attr]
