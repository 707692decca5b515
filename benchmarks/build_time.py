"""Build time per example op: cold (empty caches) and warm (a new process, caches filled).

    python benchmarks/build_time.py [--target cuda|sim] [--arch sm_90]

Runs two child processes over the ops of examples/*.py with one fresh TECC_CACHE_DIR: the first
builds every op from nothing (planning, scheduling, NVRTC), the second builds them again as a new
process would (the build cache and the compile cache filled). Prints, per op, the seconds of
`tc.build` in each (the import of tecc, ~0.2 s, is outside the figures) and the warm build's
steps. Needs no GPU: NVRTC compiles on the CPU.
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
import json, runpy, sys, time
from pathlib import Path
import tecc as tc
target, arch = sys.argv[1], sys.argv[2]
rows = []
for f in sorted(Path(sys.argv[3]).glob("*.py")):
    for op in runpy.run_path(str(f)).get("OPS", []):
        start = time.perf_counter()
        k = tc.build(list(op.args), target=target, arch=arch, sizes=op.sizes, name=op.name)
        rows.append((op.name, time.perf_counter() - start, [s for s, _ in k.timing.seconds]))
print(json.dumps(rows))
"""


def run(target: str, arch: str, cache: str) -> list[tuple[str, float, list[str]]]:
    env = dict(os.environ, TECC_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
    for knob in ("TECC_NO_CACHE", "TECC_BUILD_CACHE", "TECC_DUMP_IR"):
        env.pop(knob, None)
    out = subprocess.run([sys.executable, "-c", CHILD, target, arch, str(ROOT / "examples")], env=env,
                         capture_output=True, text=True, check=True)
    return [tuple(r) for r in json.loads(out.stdout.strip().splitlines()[-1])]  # type: ignore[misc]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="cuda", choices=("cuda", "sim"))
    ap.add_argument("--arch", default="sm_90")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        cold = run(a.target, a.arch, cache)
        warm = run(a.target, a.arch, cache)
    print(f"| op | cold build s | warm build s (new process) | warm steps |")
    print("| --- | --- | --- | --- |")
    for (name, c, _), (_, w, steps) in zip(cold, warm):
        print(f"| {name} | {c:.3f} | {w:.3f} | {', '.join(steps)} |")
    print(f"max warm build: {max(w for _, w, _ in warm) * 1e3:.0f} ms over {len(warm)} ops")


if __name__ == "__main__":
    main()
