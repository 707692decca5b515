"""The SQLite tuning database: every measurement the autotuner makes, and the winner per problem.

A *problem* is (op signature, shapes, dtypes, arch, precise math): the op's naive loop IR hashed
(`op_signature`), the concrete shapes of its arguments, their dtypes, the GPU architecture, and
whether TECC_PRECISE_MATH was on (it changes the emitted math of 16-bit sin/cos, so the times).
A *measurement* is one candidate plan of one strategy timed on that problem. Later builds look
the problem up (`TuningDB.winner`) and reuse the winning plan without measuring; `report()` pairs
the cost model's prediction with the measured time of every candidate (predicted vs measured).

Schema (version 2; `PRAGMA user_version`):

    measurements(id, op_signature, op_name, shapes, dtypes, arch, precise_math, strategy, plan,
                 plan_hash, median_us, times_us, predicted_us, ok, error, device, tecc_version, created)
        one row per timed candidate; shapes / dtypes / plan / times_us are JSON text;
        ok = 1 when the candidate matched the reference; indexed by
        (op_signature, shapes, dtypes, arch, precise_math, strategy)
    winners(op_signature, shapes, dtypes, arch, precise_math, strategy, plan, median_us,
            measurement_id, updated)
        PRIMARY KEY (op_signature, shapes, dtypes, arch, precise_math): the fastest correct candidate

Version 1 had no `precise_math`; a version-1 file is migrated when first opened, its rows reading
as precise_math = 0 (the knob's default: a row measured with the knob on cannot be told apart). A
tecc that knows only version 1 refuses the migrated file ("newer than this tecc's").

Concurrency: the file is in WAL mode; each call opens its own connection with a 30 s busy
timeout, and writes run in `BEGIN IMMEDIATE` transactions, so several processes (a process pool,
two `tecc tune` runs) may read and write one database. A winner is replaced only by a faster
measurement, whoever writes last.

Location: `TECC_TUNING_DB`, else `TECC_CACHE_DIR/tuning.sqlite` (default `~/.cache/tecc/tuning.sqlite`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import statistics
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from ...ir.errors import TeccError
from .. import options as knobs

SCHEMA_VERSION = 2

_MEASUREMENTS = """
CREATE TABLE IF NOT EXISTS measurements (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    op_signature  TEXT NOT NULL,
    op_name       TEXT NOT NULL DEFAULT '',
    shapes        TEXT NOT NULL,
    dtypes        TEXT NOT NULL,
    arch          TEXT NOT NULL,
    precise_math  INTEGER NOT NULL DEFAULT 0,
    strategy      TEXT NOT NULL,
    plan          TEXT NOT NULL,
    plan_hash     TEXT NOT NULL,
    median_us     REAL,
    times_us      TEXT NOT NULL DEFAULT '[]',
    predicted_us  REAL,
    ok            INTEGER NOT NULL DEFAULT 1,
    error         TEXT,
    device        TEXT NOT NULL DEFAULT '',
    tecc_version  TEXT NOT NULL DEFAULT '',
    created       REAL NOT NULL
)"""
_MEASUREMENTS_KEY = """
CREATE INDEX IF NOT EXISTS measurements_key
    ON measurements (op_signature, shapes, dtypes, arch, precise_math, strategy)"""
_WINNERS = """
CREATE TABLE IF NOT EXISTS winners (
    op_signature   TEXT NOT NULL,
    shapes         TEXT NOT NULL,
    dtypes         TEXT NOT NULL,
    arch           TEXT NOT NULL,
    precise_math   INTEGER NOT NULL DEFAULT 0,
    strategy       TEXT NOT NULL,
    plan           TEXT NOT NULL,
    median_us      REAL NOT NULL,
    measurement_id INTEGER REFERENCES measurements (id),
    updated        REAL NOT NULL,
    PRIMARY KEY (op_signature, shapes, dtypes, arch, precise_math)
)"""
_SCHEMA = (_MEASUREMENTS, _MEASUREMENTS_KEY, _WINNERS)

# The columns of Problem.key, as a WHERE clause.
_PROBLEM = "op_signature = ? AND shapes = ? AND dtypes = ? AND arch = ? AND precise_math = ?"


def op_signature(args: Sequence[Any], name: str | None = None) -> str:
    """SHA-256 of the op's naive loop IR (what `00_lower.txt` shows): the same computation over
    the same symbolic shapes and dtypes has the same signature, whatever its schedule."""
    from ...ir.printer import module_to_str
    from ...passes.lower import lower

    return hashlib.sha256(module_to_str(lower(list(args), name)).encode()).hexdigest()


def _canon(value: Any) -> str:
    """Canonical JSON text of shapes / dtypes / plans (tuples as lists, sorted keys, no spaces)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _plan_json(plan: Any) -> str:
    if hasattr(plan, "to_dict"):
        plan = plan.to_dict()
    elif isinstance(plan, str):
        plan = json.loads(plan)
    return _canon(plan)


@dataclass(frozen=True)
class Problem:
    """What a tuning result is valid for: op signature, argument shapes and dtypes, arch, and
    whether the build asked for precise math (TECC_PRECISE_MATH: precise sinf/cosf where a
    16-bit result would otherwise get the cheap approximations, a different kernel to time)."""

    op_signature: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    arch: str
    op_name: str = ""
    precise_math: bool = False

    @property
    def key(self) -> tuple[str, str, str, str, int]:
        return (self.op_signature, _canon([list(s) for s in self.shapes]), _canon(list(self.dtypes)), self.arch,
                int(self.precise_math))

    @staticmethod
    def of(args: Sequence[Any], shapes: Sequence[Sequence[int]], arch: str, name: str | None = None, *,
           precise_math: bool | None = None) -> "Problem":
        """The problem of build signature `args` at concrete `shapes` (one per argument) on `arch`;
        `precise_math` defaults to the TECC_PRECISE_MATH knob now (what a build now would emit)."""
        precise = knobs.precise_math() if precise_math is None else precise_math
        return Problem(op_signature(args, name), tuple(tuple(int(n) for n in s) for s in shapes),
                       tuple(t.dtype.name for t in args), arch, name or "", precise)


@dataclass(frozen=True)
class Measurement:
    id: int
    op_signature: str
    op_name: str
    shapes: Any
    dtypes: Any
    arch: str
    strategy: str
    plan: dict[str, Any]
    median_us: float | None
    times_us: list[float]
    predicted_us: float | None
    ok: bool
    error: str | None
    device: str
    tecc_version: str
    created: float
    precise_math: bool = False


@dataclass(frozen=True)
class Winner:
    strategy: str
    plan: dict[str, Any]
    median_us: float
    measurement_id: int | None


def _is_lock_error(exc: sqlite3.Error) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc))


class TuningDB:
    """The tuning database at `path` (default: TECC_TUNING_DB, else TECC_CACHE_DIR/tuning.sqlite).

    Every method opens and closes its own connection, so one TuningDB may be shared by threads and
    the same file by processes."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else knobs.tuning_db_path()
        self._ready = False

    # ---- connections --------------------------------------------------------------------------
    # seconds a write waits for another process's write transaction before giving up
    BUSY_TIMEOUT_S = 30.0

    def _connect(self) -> sqlite3.Connection:
        if self.path.exists() and not self.path.is_file():
            raise TeccError(f"the tuning database {self.path} is not a file (a directory, FIFO or device); "
                            "point TECC_TUNING_DB at a file path")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=self.BUSY_TIMEOUT_S, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            raise TeccError(f"cannot open the tuning database {self.path}: {exc}") from exc
        conn.row_factory = sqlite3.Row
        if not self._ready:
            self._init(conn)
        return conn

    def _init(self, conn: sqlite3.Connection) -> None:
        try:
            self._enter_wal(conn)
            # the version is read inside the write transaction: two processes opening a
            # version-1 file one after the other must not both migrate it
            conn.execute("BEGIN IMMEDIATE")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version <= SCHEMA_VERSION:
                if version == 1:
                    _migrate_from_1(conn)
                for statement in _SCHEMA:  # one by one: executescript() would commit the transaction
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            conn.close()
            raise self._database_error(exc) from exc
        if version > SCHEMA_VERSION:
            conn.close()
            raise TeccError(f"the tuning database {self.path} has schema version {version}, newer than this "
                            f"tecc's {SCHEMA_VERSION}; upgrade tecc or point TECC_TUNING_DB elsewhere")
        self._ready = True

    def _enter_wal(self, conn: sqlite3.Connection) -> None:
        """Switch the file to write-ahead logging. The switch needs the file to itself, and SQLite
        answers "locked" at once, without waiting, when processes that opened a new file together
        collide on it (a reader upgrading its lock would deadlock); so wait here, as a write would."""
        deadline = time.monotonic() + self.BUSY_TIMEOUT_S
        pause = 0.002
        while True:
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if not _is_lock_error(exc) or time.monotonic() > deadline:
                    raise
            time.sleep(pause)
            pause = min(2 * pause, 0.1)

    def _database_error(self, exc: sqlite3.Error) -> TeccError:
        """The TeccError for an SQLite failure: a lock held too long, or a damaged file."""
        if _is_lock_error(exc):
            # SQLite's locks die with the process that held them, so a lock that outlives
            # BUSY_TIMEOUT_S is held by a live process (or lost by a file system without locks)
            return TuningDBLocked(
                f"the tuning database {self.path} stayed locked by another process for {self.BUSY_TIMEOUT_S:.0f} s. "
                "Another tecc (tecc tune, or a build with tune=True) is writing to it: wait for it to finish, or "
                "stop it if it hangs; a process that crashed releases its lock by itself. Do not delete the file "
                "while any tecc may use it. If no tecc process runs and it stays locked, the file system does not "
                "support SQLite's locks (NFS): point TECC_TUNING_DB at a local disk")
        return TeccError(f"the tuning database {self.path} is unusable ({exc}). When no tecc process is using it, "
                         "remove it (`tecc cache clear --tuning`) and tune again, or point TECC_TUNING_DB elsewhere")

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with closing(self._connect()) as conn:
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                raise self._database_error(exc) from exc
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def _row_error(self, table: str, row: Any, exc: Exception) -> TeccError:
        return TeccError(
            f"the tuning database {self.path} has a damaged row in {table} (id or key "
            f"{row[0]!r}): {type(exc).__name__}: {exc}. Forget that problem's rows (TuningDB().forget(problem)) "
            "or, when no tecc process is using the database, remove it (`tecc cache clear --tuning`), then tune again")

    # ---- writing ------------------------------------------------------------------------------
    def record(self, problem: Problem, strategy: str, plan: Any, times_us: Sequence[float], *,
               predicted_us: float | None = None, ok: bool = True, error: str | None = None,
               device: str = "") -> int:
        """Store one candidate's measurement; when it is correct and faster than the current
        winner of `problem`, it becomes the winner. Returns the measurement's id."""
        with self._write() as conn:
            return self._record(conn, problem, strategy, plan, times_us, predicted_us, ok, error, device)

    def record_many(self, problem: Problem, results: Sequence[Mapping[str, Any]], device: str = "") -> list[int]:
        """Store a whole tuning session in one transaction. Each result has `strategy`, `plan`,
        `times_us` and optionally `predicted_us`, `ok`, `error`."""
        with self._write() as conn:
            return [self._record(conn, problem, r["strategy"], r["plan"], r.get("times_us", ()),
                                 r.get("predicted_us"), r.get("ok", True), r.get("error"), device)
                    for r in results]

    def _record(self, conn: sqlite3.Connection, problem: Problem, strategy: str, plan: Any,
                times_us: Sequence[float], predicted_us: float | None, ok: bool, error: str | None,
                device: str) -> int:
        from ..cache import tecc_version

        op, shapes, dtypes, arch, precise = problem.key
        plan_text = _plan_json(plan)
        times = [float(t) for t in times_us]
        median = statistics.median(times) if times else None
        good = bool(ok) and error is None and median is not None
        now = time.time()
        cur = conn.execute(
            "INSERT INTO measurements (op_signature, op_name, shapes, dtypes, arch, precise_math, strategy, plan, "
            "plan_hash, median_us, times_us, predicted_us, ok, error, device, tecc_version, created) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (op, problem.op_name, shapes, dtypes, arch, precise, strategy, plan_text,
             hashlib.sha256(plan_text.encode()).hexdigest(), median, json.dumps(times), predicted_us,
             int(good), error, device, tecc_version(), now))
        mid = int(cur.lastrowid or 0)
        if good:
            conn.execute(
                "INSERT INTO winners (op_signature, shapes, dtypes, arch, precise_math, strategy, plan, median_us, "
                "measurement_id, updated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (op_signature, shapes, dtypes, arch, precise_math) DO UPDATE SET "
                "strategy = excluded.strategy, plan = excluded.plan, median_us = excluded.median_us, "
                "measurement_id = excluded.measurement_id, updated = excluded.updated "
                "WHERE excluded.median_us < winners.median_us",
                (op, shapes, dtypes, arch, precise, strategy, plan_text, median, mid, now))
        return mid

    def forget(self, problem: Problem | None = None) -> int:
        """Delete the measurements and winner of `problem` (all of them with None); returns rows removed."""
        with self._write() as conn:
            if problem is None:
                n = conn.execute("DELETE FROM measurements").rowcount
                conn.execute("DELETE FROM winners")
                return n
            conn.execute(f"DELETE FROM winners WHERE {_PROBLEM}", problem.key)
            return conn.execute(f"DELETE FROM measurements WHERE {_PROBLEM}", problem.key).rowcount

    # ---- reading ------------------------------------------------------------------------------
    def winner(self, problem: Problem) -> Winner | None:
        """The fastest correct plan measured for `problem`, or None (never measured)."""
        with closing(self._connect()) as conn:
            row = conn.execute(
                f"SELECT strategy, plan, median_us, measurement_id FROM winners WHERE {_PROBLEM}",
                problem.key).fetchone()
        if row is None:
            return None
        try:
            return Winner(str(row["strategy"]), json.loads(row["plan"]), float(row["median_us"]),
                          None if row["measurement_id"] is None else int(row["measurement_id"]))
        except (TypeError, ValueError) as exc:
            raise self._row_error("winners", (problem.op_name or problem.key[0],), exc) from exc

    def best_per_strategy(self, problem: Problem) -> dict[str, Measurement]:
        """The fastest correct measurement of each strategy for `problem`."""
        best: dict[str, Measurement] = {}
        for m in self.measurements(problem):
            if m.ok and m.median_us is not None and (m.strategy not in best
                                                     or m.median_us < best[m.strategy].median_us):  # type: ignore[operator]
                best[m.strategy] = m
        return best

    def measurements(self, problem: Problem | None = None, *, strategy: str | None = None,
                     arch: str | None = None) -> list[Measurement]:
        clauses: list[str] = []
        params: list[Any] = []
        if problem is not None:
            clauses.append(_PROBLEM)
            params.extend(problem.key)
        if strategy is not None:
            clauses.append("strategy = ?")
            params.append(strategy)
        if arch is not None:
            clauses.append("arch = ?")
            params.append(arch)
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        with closing(self._connect()) as conn:
            rows = conn.execute(f"SELECT * FROM measurements{where} ORDER BY id", params).fetchall()
        out = []
        for r in rows:
            try:
                out.append(Measurement(r["id"], r["op_signature"], r["op_name"], json.loads(r["shapes"]),
                                       json.loads(r["dtypes"]), r["arch"], r["strategy"], json.loads(r["plan"]),
                                       r["median_us"], json.loads(r["times_us"]), r["predicted_us"], bool(r["ok"]),
                                       r["error"], r["device"], r["tecc_version"], r["created"],
                                       bool(r["precise_math"])))
            except (TypeError, ValueError) as exc:
                raise self._row_error("measurements", (r["id"],), exc) from exc
        return out

    def report(self, problem: Problem | None = None) -> list[dict[str, Any]]:
        """Predicted vs measured, one row per measurement that has both: op, strategy, predicted
        and measured median (µs), their ratio. The cost model's calibration reads this."""
        out = []
        for m in self.measurements(problem):
            if m.predicted_us is None or m.median_us is None:
                continue
            out.append({"op": m.op_name or m.op_signature[:12], "arch": m.arch, "precise_math": m.precise_math,
                        "strategy": m.strategy, "shapes": m.shapes, "predicted_us": m.predicted_us,
                        "measured_us": m.median_us,
                        "ratio": m.median_us / m.predicted_us if m.predicted_us else float("inf")})
        return out

    def stats(self) -> dict[str, int]:
        with closing(self._connect()) as conn:
            return {"measurements": conn.execute("SELECT COUNT(*) FROM measurements").fetchone()[0],
                    "problems": conn.execute("SELECT COUNT(*) FROM winners").fetchone()[0]}


class TuningDBLocked(TeccError):
    """Another process held the tuning database's write lock longer than TuningDB.BUSY_TIMEOUT_S."""


def _migrate_from_1(conn: sqlite3.Connection) -> None:
    """Schema 1 -> 2, inside the caller's transaction: add `precise_math` (0, the knob's default,
    in every old row) and make it part of the winners' key. SQLite cannot change a primary key in
    place, so the winners table is rebuilt."""
    conn.execute("ALTER TABLE measurements ADD COLUMN precise_math INTEGER NOT NULL DEFAULT 0")
    conn.execute("DROP INDEX IF EXISTS measurements_key")  # _SCHEMA makes it again, with the new column
    conn.execute("ALTER TABLE winners RENAME TO winners_1")
    conn.execute(_WINNERS)
    conn.execute("INSERT INTO winners (op_signature, shapes, dtypes, arch, precise_math, strategy, plan, median_us, "
                 "measurement_id, updated) SELECT op_signature, shapes, dtypes, arch, 0, strategy, plan, median_us, "
                 "measurement_id, updated FROM winners_1")
    conn.execute("DROP TABLE winners_1")
