"""The on-disk compile cache: keys, hits, corrupt entries, concurrency (tecc/compiler/cache.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tecc as tc
from tecc.compiler import cache
from tecc.compiler import build

ROOT = Path(__file__).resolve().parents[1]


def _op(scale: float = 2.0):
    n = tc.var("n")
    x = tc.placeholder((n,), "float32", name="x")
    y = tc.compute((n,), lambda i: x[i] * scale + 1.0, name="y")
    return [x, y]


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("TECC_CACHE_DIR", str(d))
    monkeypatch.delenv("TECC_NO_CACHE", raising=False)
    return d


def _hit(kernel) -> bool:
    return any(name == "nvrtc (cache hit)" for name, _ in kernel.timing.seconds)


def test_key_depends_on_everything_that_changes_the_binary() -> None:
    base = dict(arch="sm_90", name="k", options=(), nvrtc="13.0", tecc="0.1.0")
    key = cache.cache_key("src", **base)
    assert key == cache.cache_key("src", **base)
    assert len(key) == 64
    for change in (dict(arch="sm_80"), dict(name="k2"), dict(options=("-use_fast_math",)), dict(nvrtc="13.1"),
                   dict(tecc="0.2.0")):
        assert cache.cache_key("src", **(base | change)) != key, change
    assert cache.cache_key("src2", **base) != key


def test_a_split_compile_is_never_what_a_compile_check_reads(cache_dir: Path) -> None:
    """A build's final compile of several kernels uses NVRTC's split compile, whose ptxas
    C75xx warnings (the wgmma serialization the planner's check reads) come from the process's
    stderr, not NVRTC's log: its entry has a key of its own, which a one-thread compile (a check) never takes; the build takes a check's
    entry of the same source."""
    from tecc.codegen import emit_source

    from tecc.compiler import pipeline

    n = tc.var("n")
    x = tc.placeholder((n,), "float32", name="x")
    y = tc.compute((n,), lambda i: tc.exp(x[i]) * 2.0, name="y")
    z = tc.compute((n,), lambda i: tc.log(y[i] + x[i]), name="z")
    module = pipeline.schedule_module([x, y, z], pipeline.default_plan(), name="two", dumper=None,
                                      timing=pipeline.PassTiming())
    module = pipeline.finish_module(module, pipeline.default_plan(), dumper=None, timing=pipeline.PassTiming())
    source = emit_source(module.kernels)
    assert source.count("__global__") == 2
    split, hit = cache.compile_cached(source, arch="sm_90", name="two", threads=2)
    assert not hit and any(o.startswith("--split-compile") for o in split.options)
    one, hit = cache.compile_cached(source, arch="sm_90", name="two")   # as a check asks
    assert not hit and not any(o.startswith("--split-compile") for o in one.options)
    again, hit = cache.compile_cached(source, arch="sm_90", name="two", threads=2)
    assert hit and again.options == one.options   # the one-thread entry, log and all
    assert len(cache.entries()) == 2


def test_second_build_is_served_from_the_cache(cache_dir: Path) -> None:
    first = build(_op(), "cuda", name="axpb", arch="sm_90")
    assert not _hit(first)
    assert len(cache.entries()) == 1
    second = build(_op(), "cuda", name="axpb", arch="sm_90")
    assert _hit(second)
    assert second.cubin == first.cubin and second.ptx == first.ptx
    assert second.resources == first.resources and second.arch == "sm_90"
    # A different op, arch or option is a different entry.
    assert not _hit(build(_op(3.0), "cuda", name="axpb", arch="sm_90"))
    assert not _hit(build(_op(), "cuda", name="axpb", arch="sm_80"))
    assert not _hit(build(_op(), "cuda", name="axpb", arch="sm_90", options=("-use_fast_math",)))
    assert len(cache.entries()) == 4
    info = cache.info()
    assert info.entries == 4 and info.bytes > 0 and info.directory == cache_dir / "cubin" / "v2"
    assert "entries       4" in str(info)
    assert cache.clear() == 4
    assert cache.entries() == []
    assert not _hit(build(_op(), "cuda", name="axpb", arch="sm_90"))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip_cubin", "empty", "bad_json"])
def test_a_corrupt_entry_is_rebuilt_and_overwritten(cache_dir: Path, damage: str) -> None:
    good = build(_op(), "cuda", name="axpb", arch="sm_90")
    (entry,) = cache.entries()
    data = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        entry.write_bytes(os.urandom(300))
    elif damage == "flip_cubin":
        entry.write_bytes(data[:-10] + bytes(b ^ 0xFF for b in data[-10:]))
    elif damage == "empty":
        entry.write_bytes(b"")
    else:
        entry.write_bytes(cache.MAGIC + (20).to_bytes(8, "big") + b"{not json at all....")
    before = cache.STATS.corrupt
    again = build(_op(), "cuda", name="axpb", arch="sm_90")
    assert not _hit(again)
    assert cache.STATS.corrupt == before + 1
    assert again.cubin == good.cubin
    assert cache.lookup(entry.stem) is not None  # rewritten whole
    assert _hit(build(_op(), "cuda", name="axpb", arch="sm_90"))


def test_no_cache_knob_bypasses_the_cache(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TECC_NO_CACHE", "1")
    build(_op(), "cuda", name="axpb", arch="sm_90")
    k = build(_op(), "cuda", name="axpb", arch="sm_90")
    assert not _hit(k)
    assert not (cache_dir / "cubin").exists()
    assert "disabled" in str(cache.info())


def test_an_unwritable_cache_never_breaks_a_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TECC_CACHE_DIR", str(blocker / "cache"))
    before = cache.STATS.write_errors
    k = build(_op(), "cuda", name="axpb", arch="sm_90")
    assert k.cubin.startswith(b"\x7fELF")
    assert cache.STATS.write_errors == before + 1


def test_writes_leave_no_temporary_files(cache_dir: Path) -> None:
    build(_op(), "cuda", name="axpb", arch="sm_90")
    leftovers = [p for p in (cache_dir / "cubin").rglob("*") if p.is_file() and not p.name.endswith(".entry")]
    assert leftovers == []


def test_concurrent_tecc_compile_processes_share_one_fresh_cache(tmp_path: Path) -> None:
    """Four `tecc compile` of the same files at once on one empty cache: all succeed, same cubins."""
    env = dict(os.environ, TECC_CACHE_DIR=str(tmp_path / "cache"), TECC_PROGRESS="0")
    env.pop("TECC_NO_CACHE", None)
    files = [str(ROOT / "examples" / f) for f in ("elementwise.py", "matmul.py", "reduction.py", "softmax.py")]
    procs = [subprocess.Popen([sys.executable, "-m", "tecc", "compile", *files, "--arch", "sm_90",
                               "-o", str(tmp_path / f"out{i}")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(4)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert "5 op(s)" in out
    cubins = sorted(p.name for p in (tmp_path / "out0").glob("*.cubin"))
    assert len(cubins) == 5
    for name in cubins:
        blobs = {(tmp_path / f"out{i}" / name).read_bytes() for i in range(4)}
        assert len(blobs) == 1, name
    entries = cache.entries(tmp_path / "cache")
    assert len(entries) == 5
    for e in entries:
        assert cache.lookup(e.stem, tmp_path / "cache") is not None
    # A fifth run is served entirely from the cache.
    out = subprocess.run([sys.executable, "-m", "tecc", "compile", *files, "--arch", "sm_90"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "5 cubin(s) from the compile cache" in out.stdout


def test_the_suite_writes_its_builds_into_a_temporary_cache_not_the_users(tmp_path: Path) -> None:
    import tempfile

    from tecc.compiler import options as knobs

    where = knobs.cache_dir().resolve()
    assert where.is_relative_to(Path(tempfile.gettempdir()).resolve()), where
    users = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tecc"
    assert not where.is_relative_to(users.resolve())
    assert knobs.tuning_db_path().resolve().is_relative_to(where)
    f = tc.build(_op(3.0), target="cuda", arch="sm_90")  # NVRTC's output lands in the session's cache
    assert f.cubin[:4] == b"\x7fELF" and any(cache.entries())
    assert all(e.resolve().is_relative_to(where) for e in cache.entries())
