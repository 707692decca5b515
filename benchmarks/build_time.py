"""Build time per op: cold (empty caches) and warm (a new process, caches filled).

    python benchmarks/build_time.py [--target cuda|sim] [--arch sm_90] [--ops examples|planning]
                                    [--profile DIR] [--shared-process]

Builds every op twice, each time in a new process with the op's own TECC_CACHE_DIR: cold (empty
caches: planning, scheduling, NVRTC; the process's first build, so it also pays the first use of
NVRTC and of the compiler's modules) and warm (a new process, the build cache and the compile
cache filled). Prints, per op, the seconds of `tc.build` in each (the import of tecc, ~0.2 s, is
outside the figures), split into NVRTC (every compile of the build: the planner's ptxas checks
and the final kernel's; `compiles` counts them) and the rest (planning, scheduling, emitting
CUDA C), the process's CPU seconds of the cold build (steadier than the wall clock on a
shared machine), and the warm build's steps. Needs no GPU: NVRTC compiles on the CPU. --shared-process
builds all ops cold in one process instead (then only the first pays the first-use costs).

--ops examples (the default): the ops of examples/*.py. --ops planning: the sizes of the
planning-time targets (issues 14 and 16): fp32 and fp16 4096³ GEMMs, fp16 attention
(B, H, S, d = 4, 16, 4096, 128), the fp16 and fp32 ResNet-50 3x3 conv 32x28x28x128->128
(benchmarks/conv.py's layer). --profile DIR writes a cProfile of each cold build to DIR/<op>.prof.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import cProfile, json, runpy, sys, time
from pathlib import Path
import tecc as tc
from tecc.codegen import nvrtc
target, arch, which, profile = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
spent = [0.0, 0.0, 0]  # NVRTC wall seconds, NVRTC CPU seconds, compiles
inner = nvrtc._compile
def timed(*a, **kw):
    start, cpu = time.perf_counter(), time.process_time()
    try:
        return inner(*a, **kw)
    finally:
        spent[0] += time.perf_counter() - start
        spent[1] += time.process_time() - cpu
        spent[2] += 1
nvrtc._compile = timed
if which == "examples":
    ops = [op for f in sorted(Path(sys.argv[5]).glob("*.py")) for op in runpy.run_path(str(f)).get("OPS", [])]
else:
    ops = runpy.run_path(sys.argv[5])["planning_ops"]()
only = int(sys.argv[6])
rows = []
for index, op in enumerate(ops):
    if only >= 0 and index != only:
        continue
    spent[:] = [0.0, 0.0, 0]
    prof = cProfile.Profile() if profile != "-" else None
    start, cpu = time.perf_counter(), time.process_time()
    if prof is not None:
        prof.enable()
    k = tc.build(list(op.args), target=target, arch=arch, sizes=op.sizes, name=op.name)
    total, total_cpu = time.perf_counter() - start, time.process_time() - cpu
    if prof is not None:
        prof.disable()
        prof.dump_stats(str(Path(profile) / f"{op.name}.prof"))
    rows.append((op.name, total, spent[0], spent[2], [s for s, _ in k.timing.seconds], k.plan.strategy,
                 total_cpu, spent[1]))
print(json.dumps(rows))
"""


def planning_ops() -> list:
    """The planning-time targets' programs (see the module docstring)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import tecc as tc
    from attention import attention_tensors
    from conv import conv_tensors
    from gemm import matmul_tensors

    return [tc.OpSpec("gemm_f32_4096", matmul_tensors(1, 4096, 4096, 4096, "float32"), None),
            tc.OpSpec("gemm_f16_4096", matmul_tensors(1, 4096, 4096, 4096, "float16"), None),
            tc.OpSpec("attention_f16_4x16x4096x128", attention_tensors(4, 16, 4096, 128, "float16", False), None),
            tc.OpSpec("conv3x3_f16_32x28x28x128", conv_tensors(32, 28, 28, 128, 128, 3, 1, "float16"), None),
            tc.OpSpec("conv3x3_f32_32x28x28x128", conv_tensors(32, 28, 28, 128, 128, 3, 1, "float32"), None)]


Row = tuple  # (op, build s, NVRTC s, compiles, steps, strategy, build CPU s, NVRTC CPU s)


def run(target: str, arch: str, cache: str, ops: str, profile: str | None = None, only: int = -1) -> list[Row]:
    env = dict(os.environ, TECC_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
    for knob in ("TECC_NO_CACHE", "TECC_BUILD_CACHE", "TECC_DUMP_IR"):
        env.pop(knob, None)
    source = str(ROOT / "examples") if ops == "examples" else str(Path(__file__).resolve())
    out = subprocess.run([sys.executable, "-c", CHILD, target, arch, ops, profile or "-", source, str(only)],
                         env=env, capture_output=True, text=True, check=True)
    return [tuple(r) for r in json.loads(out.stdout.strip().splitlines()[-1])]


def count_ops(ops: str) -> int:
    if ops == "examples":
        import runpy
        return sum(len(runpy.run_path(str(f)).get("OPS", [])) for f in sorted((ROOT / "examples").glob("*.py")))
    sys.path.insert(0, str(ROOT))
    return len(planning_ops())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="cuda", choices=("cuda", "sim"))
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--ops", default="examples", choices=("examples", "planning"))
    ap.add_argument("--profile", default=None, help="directory for a cProfile of each cold build")
    ap.add_argument("--shared-process", action="store_true", help="all cold builds in one process")
    a = ap.parse_args()
    if a.profile:
        Path(a.profile).mkdir(parents=True, exist_ok=True)
    if a.shared_process:
        with tempfile.TemporaryDirectory() as cache:
            cold = run(a.target, a.arch, cache, a.ops, a.profile)
            warm = run(a.target, a.arch, cache, a.ops)
    else:
        cold, warm = [], []
        for index in range(count_ops(a.ops)):
            with tempfile.TemporaryDirectory() as cache:
                cold += run(a.target, a.arch, cache, a.ops, a.profile, index)
                warm += run(a.target, a.arch, cache, a.ops, None, index)
    print("| op | plan | cold build s | of it NVRTC s (compiles) | cold without NVRTC s | cold CPU s (NVRTC CPU s) "
          "| warm build s (new process) | warm steps |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (name, c, nv, n, _, strategy, c_cpu, nv_cpu), (_, w, _, _, steps, *_) in zip(cold, warm):
        print(f"| {name} | {strategy} | {c:.3f} | {nv:.3f} ({n}) | {c - nv:.3f} | {c_cpu:.3f} ({nv_cpu:.3f}) | {w:.3f} "
              f"| {', '.join(steps)} |")
    print(f"max warm build: {max(r[1] for r in warm) * 1e3:.0f} ms over {len(warm)} ops")


if __name__ == "__main__":
    main()
