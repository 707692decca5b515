"""Save the 4096^3 gemm_pipelined kernel (128x128, k-tile 8) and count its SASS instructions.

    python benchmarks/gemm_sass.py OUTDIR [bm bn bk]

Writes OUTDIR/gemm_pipelined.{cu,ptx,cubin,json}, and with `cuobjdump` on the PATH (or in
/usr/local/cuda/bin) OUTDIR/gemm_pipelined.sass plus the counts of FFMA, LDS.128, LDS (all),
LDG.E.128, STS.128, LDL/STL (local memory: spills) and BAR in the kernel.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import tecc as tc
    from gemm import matmul_tensors
    from tecc.compiler.cost.analysis import analyze_kernel
    from tecc.compiler.schedule import Schedule
    from tecc.compiler.strategies import get
    from tecc.passes.lower import lower

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    bm, bn, bk = (int(x) for x in sys.argv[2:5]) if len(sys.argv) >= 5 else (128, 128, 8)
    args = matmul_tensors(1, 4096, 4096, 4096)
    info = analyze_kernel(lower(args).kernels[0])
    sch = Schedule(args)
    get("gemm_pipelined").apply(sch, info, {"bm": bm, "bn": bn, "bk": bk})
    kern = tc.build(sch)
    kern.save(str(out / "gemm_pipelined"))
    print("resources:", getattr(kern, "resources", None))
    tool = shutil.which("cuobjdump") or next((p for p in ("/usr/local/cuda/bin/cuobjdump",) if Path(p).exists()), None)
    if tool is None:
        print("no cuobjdump on this machine: SASS not dumped (the .cubin is saved)")
        return
    sass = subprocess.run([tool, "--dump-sass", str(out / "gemm_pipelined.cubin")], capture_output=True, text=True).stdout
    (out / "gemm_pipelined.sass").write_text(sass)
    for name, pat in [("FFMA", r"\bFFMA\b"), ("LDS.128", r"\bLDS\.128\b"), ("LDS all", r"\bLDS(\.\w+)?\b"),
                      ("LDG.E.128", r"\bLDG\.E\.128"), ("LDG all", r"\bLDG\b"), ("STS.128", r"\bSTS\.128\b"),
                      ("STS all", r"\bSTS\b"), ("LDL", r"\bLDL\b"), ("STL", r"\bSTL\b"), ("BAR", r"\bBAR\b")]:
        print(f"{name:10s} {len(re.findall(pat, sass))}")


if __name__ == "__main__":
    main()
