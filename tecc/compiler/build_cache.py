"""The build cache: what plan="auto" chose for a program, and the final loop IR it gave, on disk.

A cold build plans (the cost model over every strategy's space) and schedules (the primitives,
with islpy's dependence checks): a second or more for a GEMM. A program built before, in this
process or an earlier one, needs neither: `build` looks the program up here first and, on a hit,
emits CUDA C from the stored final loop IR (and NVRTC's output comes from the compile cache).

The key is the SHA-256 of

    the cache format, the program's naive loop IR (what `00_lower.txt` shows: shapes, dtypes,
    names, the expressions), the module name, the sizes planned for, the Target planned for (its
    arch and every figure the cost model reads: an H100 and an H200 are both sm_90), the knobs
    that change the IR (precise math), whether the build allowed TF32 (`allow_tf32`), and the fingerprint of tecc's own source files

so a change to the program, its sizes, the target, or to the compiler itself (any file of the
`tecc` package, not only a release number) gives another entry. Builds that ask for dumps
(`dump_ir`, TECC_DUMP_IR) or for tuning, and explicit plans, do not use it; `TECC_NO_CACHE=1`
turns it off with the compile cache, `TECC_BUILD_CACHE=0` alone (the test suite does: its tests
change strategies and the cost model on purpose, which the fingerprint of the files cannot see).

Layout: `TECC_CACHE_DIR/builds/v2/<key[:2]>/<key>.json`: `{"key", "plan", "module", "report"}`,
the module as the artifacts' loop-IR JSON (tecc.ir.loop_json), the report the planner's
explanation (`explain.explain` of its PlanResult: the ranking, the cost breakdown, the runners-up;
null when the plan came from a graph-level rewrite, whose plan says why itself), so that
`f.explain()` of a cached build says what the build that planned it said. Written to a temporary
file and renamed, as the compile cache does. An entry that cannot be read or decoded is a miss
and is rewritten; nothing here fails a build. `entries()` lists them, `clear()` removes them
(`tecc cache info` / `tecc cache clear`, through tecc.compiler.cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from ..ir.errors import TeccError
from ..ir.loop_json import module_from_json, module_to_json
from ..ir.stmt import Module
from . import options as knobs
from .plan import Plan

FORMAT = 2  # 2: the entry keeps the planner's report
SUBDIR = f"builds/v{FORMAT}"

_FINGERPRINT: str | None = None


def source_fingerprint() -> str:
    """SHA-256 over the path and contents of every .py file of the tecc package (once per
    process): the build cache's stand-in for "the same compiler"."""
    global _FINGERPRINT
    if _FINGERPRINT is None:
        package = Path(__file__).resolve().parent.parent  # tecc/
        digest = hashlib.sha256()
        for path in sorted(package.rglob("*.py")):
            digest.update(str(path.relative_to(package)).encode())
            digest.update(path.read_bytes())
        _FINGERPRINT = digest.hexdigest()
    return _FINGERPRINT


def build_key(naive_ir: str, *, name: str, sizes: Mapping[str, int] | None, target: str,
              allow_tf32: bool = False) -> str:
    """The hex SHA-256 that names a build-cache entry (module docstring)."""
    fields = {
        "format": FORMAT,
        "program": hashlib.sha256(naive_ir.encode()).hexdigest(),
        "name": name,
        "sizes": sorted((str(k), int(v)) for k, v in (sizes or {}).items()),
        "target": target,
        "precise_math": knobs.precise_math(),
        "allow_tf32": bool(allow_tf32),
        "tecc": source_fingerprint(),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def root(directory: str | os.PathLike[str] | None = None) -> Path:
    """Where entries live: DIR/builds/v2 (DIR = `directory`, else TECC_CACHE_DIR's)."""
    return (Path(directory) if directory is not None else knobs.cache_dir()) / SUBDIR


def entry_path(key: str) -> Path:
    return root() / key[:2] / f"{key}.json"


class CachedBuild(NamedTuple):
    """An entry: the plan, the final loop IR, and the planner's report (None: no planner ran)."""

    plan: Plan
    module: Module
    report: str | None


def lookup(key: str) -> CachedBuild | None:
    """The stored build for `key`, or None (no entry, or one that cannot be read)."""
    path = entry_path(key)
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return None
        doc = json.loads(path.read_text())
        if doc.get("key") != key:
            return None
        report = doc.get("report")
        return CachedBuild(Plan.from_json(doc["plan"]), module_from_json(doc["module"], f"build cache entry {path}"),
                           report if isinstance(report, str) else None)
    except (OSError, ValueError, KeyError, TypeError, TeccError):
        return None


def store(key: str, plan: Plan, module: Module, planning: Any = None) -> Path | None:
    """Write the entry atomically, with the report of `planning` (the planner's PlanResult, when
    it chose the plan); None when it cannot be written (never raises for the disk, nor for a
    module the loop-IR JSON does not know)."""
    path = entry_path(key)
    tmp_name = None
    try:
        report = None
        if planning is not None:
            from .explain import explain

            report = explain(planning)
        text = json.dumps({"key": key, "plan": plan.to_json(), "module": module_to_json(module), "report": report})
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp_name, path)
        return path
    except (OSError, TeccError):
        if tmp_name is not None:
            try:
                os.unlink(tmp_name)
            except OSError:
                pass
        return None


def entries(directory: str | os.PathLike[str] | None = None) -> list[Path]:
    """Every entry file (of this format) under the cache directory."""
    base = root(directory)
    return sorted(base.glob("*/*.json")) if base.is_dir() else []


def clear(directory: str | os.PathLike[str] | None = None) -> int:
    """Remove every entry, of every format version; returns how many of this format there were.
    Safe while other processes build: they plan again on a miss."""
    removed = len(entries(directory))
    shutil.rmtree(root(directory).parent, ignore_errors=True)
    return removed


__all__ = ["CachedBuild", "build_key", "clear", "entries", "entry_path", "lookup", "root", "source_fingerprint",
           "store"]
