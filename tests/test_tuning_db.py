"""The SQLite tuning database (tecc/compiler/tuning_db.py)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import tecc as tc
from tecc.compiler.tuning_db import Problem, TuningDB, op_signature
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
from tecc.compiler.tuning_db import Problem, TuningDB
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
