"""The C++ deployment example (examples/deploy/): header generation, build, and a run on the GPU."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tecc.cli import main as tecc_main

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "examples" / "deploy"

_spec = importlib.util.spec_from_file_location("gen_header", DEPLOY / "gen_header.py")
assert _spec is not None and _spec.loader is not None
gen_header = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_header)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("artifacts")
    old = os.environ.get("TECC_PROGRESS")
    os.environ["TECC_PROGRESS"] = "0"
    try:
        assert tecc_main(["compile", str(ROOT / "examples"), "-o", str(out)]) == 0
    finally:
        if old is None:
            os.environ.pop("TECC_PROGRESS", None)
        else:
            os.environ["TECC_PROGRESS"] = old
    return out


def _compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


def _cuda_include() -> Path | None:
    nvcc = shutil.which("nvcc")
    candidates = [Path(os.environ["CUDA_HOME"]) / "include"] if os.environ.get("CUDA_HOME") else []
    candidates += [Path("/usr/local/cuda/include"), *sorted(Path("/usr/local").glob("cuda-*/include"))]
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    return next((c for c in candidates if (c / "cuda.h").exists()), None)


def test_headers_of_every_example_compile_as_c_and_cpp(artifacts: Path, tmp_path: Path) -> None:
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler (g++) on this machine")
    names = sorted(p.stem for p in artifacts.glob("*.json"))
    assert len(names) >= 5
    for n in names:
        assert gen_header.main([str(artifacts / f"{n}.json"), "-o", str(tmp_path / f"{n}.h")]) == 0
    src = tmp_path / "all.c"
    src.write_text("".join(f'#include "{n}.h"\n' for n in names) + "int main(void) { return 0; }\n")
    for lang, std in (("c", "-std=c99"), ("c++", "-std=c++17")):
        r = subprocess.run([cxx, "-x", lang, std, "-Wall", "-Wextra", "-Werror", "-fsyntax-only", f"-I{tmp_path}",
                            str(src)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_header_launch_configuration_matches_the_runtime(artifacts: Path, tmp_path: Path) -> None:
    """Evaluate every launch of the header in C and compare with tecc's own resolve_launch."""
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no C++ compiler (g++) on this machine")
    from tecc.runtime.artifact import read_manifest
    from tecc.runtime.host import HostProgram, resolve_launch

    gen_header.main([str(artifacts / "sin_axpb.json"), "-o", str(tmp_path / "sin_axpb.h")])
    gen_header.main([str(artifacts / "softmax.json"), "-o", str(tmp_path / "softmax.h")])
    prog = tmp_path / "probe.cpp"
    prog.write_text(r'''
#include <cstdio>
#include <initializer_list>
#include "sin_axpb.h"
#include "softmax.h"
int main() {
    for (long long R : {0LL, 1LL, 255LL, 256LL, 257LL, 100000LL}) {
        sin_axpb_sizes s{}; s.R = R; s.C = 129; s.x_stride0 = 129; s.x_stride1 = 1;
        sin_axpb_buffers b{1, 2, 3, 4}; tecc_launch l;
        int st = sin_axpb_launch(0, &s, &b, &l);
        std::printf("sin_axpb %lld %d %u %u %u %u %d %llu %d %d\n", R, st, st ? l.grid[0] : 0, l.grid[1], l.grid[2],
                    l.block[0], l.num_params, (unsigned long long)l.values[3].ptr, l.values[4].i32, l.values[5].i32);
        softmax_sizes t{}; t.R = R; softmax_buffers c{1, 2};
        for (int i = 0; i < SOFTMAX_NUM_LAUNCHES; ++i) {
            int st2 = softmax_launch(i, &t, &c, &l);
            std::printf("softmax %lld %d %s %u\n", R, st2, st2 ? l.kernel : "-", st2 ? l.grid[0] : 0);
        }
        if (softmax_launch(SOFTMAX_NUM_LAUNCHES, &t, &c, &l) != -1) return 1;
    }
}
''')
    exe = tmp_path / "probe"
    r = subprocess.run([cxx, "-std=c++17", f"-I{tmp_path}", str(prog), "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()
    sin_host = HostProgram.from_json(read_manifest(artifacts / "sin_axpb")["host"])
    soft_host = HostProgram.from_json(read_manifest(artifacts / "softmax")["host"])
    it = iter(lines)
    for R in (0, 1, 255, 256, 257, 100000):
        fields = next(it).split()
        k = sin_host.kernels[0]
        env = {v: n for v, n in zip(sin_host.size_vars, (R, 129, 129, 1))}
        grid, block = resolve_launch(k, env)
        if grid[0] <= 0:
            assert fields[2] == "0"
        else:
            assert [int(x) for x in fields[3:7]] == [grid[0], grid[1], grid[2], block[0]], (R, fields)
            assert fields[7:] == ["8", "4", str(R), "129"]
        for k in soft_host.kernels:
            f = next(it).split()
            env = {v: R for v in soft_host.size_vars}
            grid, _ = resolve_launch(k, env)
            assert f[3] == (k.name if grid[0] > 0 else "-")
            assert int(f[4]) == (grid[0] if grid[0] > 0 else 0)


def test_header_generator_refuses_unknown_manifests(artifacts: Path, tmp_path: Path) -> None:
    import json

    m = json.loads((artifacts / "matmul.json").read_text())
    m["version"] = 99
    with pytest.raises(gen_header.HeaderError, match="version 99"):
        gen_header.generate(m)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert gen_header.main([str(bad)]) == 2


def _make(artifacts_dir: Path, build: Path, *targets: str) -> subprocess.CompletedProcess[str]:
    tecc = f"{sys.executable} -m tecc"
    return subprocess.run(["make", "-C", str(DEPLOY), f"BUILD={build}", f"TECC={tecc}", f"PYTHON={sys.executable}",
                           *targets], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TECC_PROGRESS="0"))


def test_the_deploy_example_builds(tmp_path: Path) -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    if shutil.which("nvcc") is None and (_compiler() is None or _cuda_include() is None):
        pytest.skip("neither nvcc nor g++ with the CUDA headers (cuda.h) is available to build the C++ example")
    build = tmp_path / "build"
    r = _make(build, build)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (build / "deploy_demo").exists()
    assert (build / "include" / "sin_axpb.h").exists() and (build / "artifacts" / "softmax.cubin").exists()


@pytest.mark.gpu
def test_the_deploy_example_runs_on_the_gpu_and_matches(tmp_path: Path) -> None:
    if shutil.which("make") is None or (shutil.which("nvcc") is None and _compiler() is None):
        pytest.skip("no make / nvcc / g++ to build the C++ example")
    build = tmp_path / "build"
    r = _make(build, build, "run")
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all runs match the reference" in r.stdout
    assert r.stdout.count("PASS") == 5 and "FAIL" not in r.stdout
