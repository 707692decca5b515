"""The on-disk compile cache: NVRTC's output (cubin, PTX, ptxas report) keyed by what determines it.

`build` goes through `compile_cached` instead of calling NVRTC directly. The key is the SHA-256 of

    cache format version, the CUDA C source (a deterministic function of the final loop IR),
    the module name (NVRTC's program name), the arch, the extra NVRTC options,
    the tecc version and the NVRTC version

so a different schedule, arch, option, tecc release or NVRTC gives a different entry, and the same
build on the same machine is served from disk (docs/cache.md shows the timings).

Layout: `TECC_CACHE_DIR/cubin/v1/<key[:2]>/<key>.entry`, one file per entry:

    b"TECC-CACHE 1\\n" | 8-byte big-endian length L | L bytes of JSON metadata | cubin bytes

The JSON holds the key, the PTX, the NVRTC log, arch, NVRTC version, full option list, the
per-kernel resources and the SHA-256 of the cubin and of the PTX. An entry is written to a
temporary file in the same directory and renamed over the final name (`os.replace`, atomic on
POSIX and Windows), so a reader sees either no entry or a whole one, never a half-written file,
and two processes compiling the same kernel at once both succeed (the second rename wins with
identical content). A reader that finds an entry it cannot parse or whose hashes do not match
treats it as a miss: the kernel is recompiled and the entry overwritten. Nothing here raises
on a broken or unwritable cache; only NVRTC's own errors reach the caller.

`TECC_NO_CACHE=1` bypasses the cache; `TECC_CACHE_DIR` moves it (default `~/.cache/tecc`).
`tecc cache info` / `tecc cache clear` (or `info()` / `clear()`) inspect and empty it, and the
build cache beside it (`info()` counts its entries; `build_cache.clear()` empties it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..codegen import CompiledCode, KernelResources, compile_cuda
from ..codegen.nvrtc import nvrtc_version, split_compile_flags
from . import build_cache
from . import options as knobs

# stands in the key of an entry compiled with NVRTC's split compile (compile_cached)
SPLIT_KEY = "(split compile)"
CACHE_FORMAT = 2  # 2: resources always from a ptxas report (format 1 could keep none: nvrtc.compile_cuda)
MAGIC = b"TECC-CACHE 1\n"
SUBDIR = f"cubin/v{CACHE_FORMAT}"


def tecc_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("tecc")
    except metadata.PackageNotFoundError:  # running from a source tree that was never installed
        from ..version import __version__

        return __version__


def cache_key(source: str, *, arch: str, name: str, options: Sequence[str], nvrtc: str | None = None,
              tecc: str | None = None) -> str:
    """The hex SHA-256 that names a compile-cache entry."""
    fields = {
        "format": CACHE_FORMAT,
        "source": hashlib.sha256(source.encode()).hexdigest(),
        "name": name,
        "arch": arch,
        "options": list(options),
        "tecc": tecc if tecc is not None else tecc_version(),
        "nvrtc": nvrtc if nvrtc is not None else nvrtc_version(),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def root(directory: str | os.PathLike[str] | None = None) -> Path:
    """Where entries live: DIR/cubin/v1 (DIR = `directory`, else TECC_CACHE_DIR, else ~/.cache/tecc)."""
    return (Path(directory) if directory is not None else knobs.cache_dir()) / SUBDIR


def entry_path(key: str, directory: str | os.PathLike[str] | None = None) -> Path:
    return root(directory) / key[:2] / f"{key}.entry"


# ---- encoding ---------------------------------------------------------------------------------

def encode(key: str, code: CompiledCode) -> bytes:
    meta = {
        "key": key,
        "ptx": code.ptx,
        "log": code.log,
        "arch": code.arch,
        "nvrtc_version": code.nvrtc_version,
        "options": list(code.options),
        "resources": {k: dataclasses.asdict(v) for k, v in code.resources.items()},
        "cubin_sha256": hashlib.sha256(code.cubin).hexdigest(),
        "ptx_sha256": hashlib.sha256(code.ptx.encode()).hexdigest(),
        "created": time.time(),
    }
    blob = json.dumps(meta).encode()
    return MAGIC + len(blob).to_bytes(8, "big") + blob + bytes(code.cubin)


class CorruptEntry(Exception):
    """An entry that cannot be trusted (truncated, wrong magic, hash mismatch); never escapes this module."""


def decode(data: bytes, key: str) -> CompiledCode:
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise CorruptEntry("bad header")
    start = len(MAGIC) + 8
    length = int.from_bytes(data[len(MAGIC):start], "big")
    if start + length > len(data):
        raise CorruptEntry("truncated metadata")
    try:
        meta = json.loads(data[start:start + length])
        cubin = data[start + length:]
        if meta["key"] != key:
            raise CorruptEntry("key mismatch")
        if hashlib.sha256(cubin).hexdigest() != meta["cubin_sha256"] or not cubin.startswith(b"\x7fELF"):
            raise CorruptEntry("cubin hash mismatch")
        if hashlib.sha256(meta["ptx"].encode()).hexdigest() != meta["ptx_sha256"]:
            raise CorruptEntry("ptx hash mismatch")
        resources = {k: KernelResources(**v) for k, v in meta["resources"].items()}
        return CompiledCode(ptx=meta["ptx"], cubin=cubin, resources=resources, log=meta["log"], arch=meta["arch"],
                            nvrtc_version=meta["nvrtc_version"], options=tuple(meta["options"]))
    except CorruptEntry:
        raise
    except Exception as exc:  # noqa: BLE001 - any parse failure means the entry is unusable
        raise CorruptEntry(f"{type(exc).__name__}: {exc}") from exc


# ---- reading and writing ----------------------------------------------------------------------

@dataclass
class CacheStats:
    """What this process did with the cache (hits, misses, corrupt entries rebuilt, write failures),
    and where the latest hit came from: `compiled` maps each key this process compiled to the
    count of misses then, so a hit can be told apart from a reuse of an earlier build's binary
    when this very build compiled it a moment before (the planner's ptxas checks do)."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    write_errors: int = 0
    last_hit: str = ""
    compiled: dict[str, int] = field(default_factory=dict)

    def last_hit_compiled_after(self, misses: int) -> bool:
        """Whether the latest hit was on an entry this process compiled after `misses` misses
        (read `STATS.misses` before a build, ask this after it)."""
        return self.compiled.get(self.last_hit, 0) > misses


STATS = CacheStats()


def lookup(key: str, directory: str | os.PathLike[str] | None = None) -> CompiledCode | None:
    """The entry for `key`, or None when there is none or it is corrupt (counted in STATS.corrupt)."""
    path = entry_path(key, directory)
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            # a FIFO would block the read forever, a directory cannot be read: not an entry
            STATS.corrupt += 1
            return None
        data = path.read_bytes()
    except OSError:
        return None
    try:
        return decode(data, key)
    except CorruptEntry:
        STATS.corrupt += 1
        return None


def store(key: str, code: CompiledCode, directory: str | os.PathLike[str] | None = None) -> Path | None:
    """Write the entry atomically (temp file in the same directory, fsync, rename). Returns its
    path, or None when the cache cannot be written (read-only disk, full disk...): never raises."""
    path = entry_path(key, directory)
    tmp_name = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(encode(key, code))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
        return path
    except OSError:
        STATS.write_errors += 1
        if tmp_name is not None:
            try:
                os.unlink(tmp_name)
            except OSError:
                pass
        return None


def compile_cached(source: str, *, arch: str, name: str, options: Sequence[str] = (),
                   threads: int = 1) -> tuple[CompiledCode, bool]:
    """`compile_cuda` through the cache: (compiled code, True when it came from the cache).

    `threads` > 1 (a build's final compile): a source of several kernels is compiled with
    NVRTC's split compile (compile_cuda), whose kernels' machine code is the same but whose log
    lacks ptxas's performance warnings (C75xx: they go to the process's stderr), which the
    planner's compile checks read. So such an entry is stored under a key of its own, which a
    check never looks up; the build still takes a check's entry for the same source first.

    With TECC_NO_CACHE=1 this is `compile_cuda` (never a hit, nothing written)."""
    if not knobs.cache_enabled():
        return compile_cuda(source, arch=arch, name=name, options=options, threads=threads), False
    keys = [cache_key(source, arch=arch, name=name, options=options)]
    if split_compile_flags(source, threads):
        keys.append(cache_key(source, arch=arch, name=name, options=(*options, SPLIT_KEY)))
    for key in keys:
        hit = lookup(key)
        if hit is not None:
            STATS.hits += 1
            STATS.last_hit = key
            return hit, True
    STATS.misses += 1
    code = compile_cuda(source, arch=arch, name=name, options=options, threads=threads)
    key = keys[-1]
    store(key, code)
    STATS.compiled[key] = STATS.misses
    return code, False


# ---- maintenance ------------------------------------------------------------------------------

@dataclass(frozen=True)
class CacheInfo:
    """What `tecc cache info` shows: the compile cache, the build cache (build_cache.py: plans
    and final loop IR) and the tuning database."""

    directory: Path
    entries: int
    bytes: int
    tuning_db: Path
    tuning_db_bytes: int
    enabled: bool
    build_directory: Path = Path()
    build_entries: int = 0
    build_bytes: int = 0
    build_enabled: bool = True

    def __str__(self) -> str:
        state = "" if self.enabled else " (disabled by TECC_NO_CACHE)"
        build_state = ("" if self.build_enabled else
                       " (disabled by TECC_NO_CACHE)" if not self.enabled else " (disabled by TECC_BUILD_CACHE=0)")
        return (f"compile cache   {self.directory}{state}\n"
                f"  entries       {self.entries}\n"
                f"  size          {_human(self.bytes)}\n"
                f"build cache     {self.build_directory}{build_state}\n"
                f"  entries       {self.build_entries}\n"
                f"  size          {_human(self.build_bytes)}\n"
                f"tuning database {self.tuning_db}"
                f"{'' if self.tuning_db_bytes else ' (none yet)'}\n"
                f"  size          {_human(self.tuning_db_bytes)}")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def entries(directory: str | os.PathLike[str] | None = None) -> list[Path]:
    base = root(directory)
    return sorted(base.glob("*/*.entry")) if base.is_dir() else []


def _size(files: list[Path]) -> int:
    size = 0
    for f in files:
        try:
            size += f.stat().st_size
        except OSError:
            pass
    return size


def info(directory: str | os.PathLike[str] | None = None) -> CacheInfo:
    files, builds = entries(directory), build_cache.entries(directory)
    db = knobs.tuning_db_path() if directory is None else Path(directory) / "tuning.sqlite"
    db_bytes = db.stat().st_size if db.exists() else 0
    return CacheInfo(root(directory), len(files), _size(files), db, db_bytes, knobs.cache_enabled(),
                     build_cache.root(directory), len(builds), _size(builds), knobs.build_cache_enabled())


def clear(directory: str | os.PathLike[str] | None = None, *, tuning: bool = False) -> int:
    """Remove every compile-cache entry (and the tuning database with `tuning=True`); returns how
    many entries were removed. Safe while other processes build: they recompile on a miss. (The
    build cache is `build_cache.clear()`; `tecc cache clear` empties both.)"""
    removed = len(entries(directory))
    base = Path(directory) if directory is not None else knobs.cache_dir()
    shutil.rmtree(base / "cubin", ignore_errors=True)
    if tuning:
        db = knobs.tuning_db_path() if directory is None else base / "tuning.sqlite"
        for suffix in ("", "-wal", "-shm"):
            try:
                os.unlink(str(db) + suffix)
            except OSError:
                pass
    return removed
