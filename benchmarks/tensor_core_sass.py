"""Save the planner's tensor-core GEMM kernel and count its SASS instructions.

    python benchmarks/tensor_core_sass.py OUTDIR [M N K] [--dtype float16|bfloat16|float32] [--tf32]
        [--point BM BN WM WN BK STAGES [--fragment-pipeline] [--group G]]

Writes OUTDIR/tc_gemm.{cu,ptx,cubin,json}, and with `cuobjdump` on the PATH (or in
/usr/local/cuda/bin) OUTDIR/tc_gemm.sass plus the counts of HMMA, LDSM (ldmatrix), LDGSTS
(cp.async), BAR, DEPBAR (cp.async waits), and on sm_90 HGMMA (wgmma), UTMALDG / UTMASTG (TMA
loads / stores), SYNCS (mbarrier operations) and USETMAXREG (setmaxnreg); the integer instructions (IMAD, IADD3, LOP3, SHF: address
arithmetic) and local-memory traffic (LDL/STL) in the kernel.
"""

from __future__ import annotations

import argparse
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

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("shape", type=int, nargs="*", default=[4096, 4096, 4096])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--tf32", action="store_true", help="float32 with allow_tf32=True")
    ap.add_argument("--point", type=int, nargs=6, metavar=("BM", "BN", "WM", "WN", "BK", "STAGES"),
                    help="this mma.sync tensorize point instead of the planner's choice")
    ap.add_argument("--fragment-pipeline", action="store_true", help="with --point: the pipelined mainloop")
    ap.add_argument("--group", type=int, default=0, help="with --point: the grouped block order (group_m)")
    a = ap.parse_args()
    m, n, k = a.shape
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = matmul_tensors(1, m, n, k, a.dtype)
    plan: object = "auto"
    if a.point:
        bm, bn, wm, wn, bk, stages = a.point
        sch = tc.Schedule(tensors)
        k_tiles = sch.tensorize("C", "mma.m16n8k8.f32.tf32" if a.tf32 else "auto", block=(bm, bn), warps=(wm, wn),
                                k_tile=bk)
        for operand in sch.gemm_operands("C"):
            sch.stage_operand("C", operand)
        sch.pipeline(k_tiles, stages=stages)
        if a.fragment_pipeline:
            sch.pipeline_fragments(k_tiles)
        if a.group:
            sch.tile_order("C", a.group)
        plan = sch.plan
    kern = tc.build(tensors, allow_tf32=a.tf32, plan=plan)
    kern.save(str(out / "tc_gemm"))
    print("plan:", kern.plan.reason.split(";")[0])
    print("resources:", getattr(kern, "resources", None))
    tool = shutil.which("cuobjdump") or next((p for p in ("/usr/local/cuda/bin/cuobjdump",) if Path(p).exists()), None)
    if tool is None:
        print("no cuobjdump on this machine: SASS not dumped (the .cubin is saved)")
        return
    sass = subprocess.run([tool, "--dump-sass", str(out / "tc_gemm.cubin")], capture_output=True, text=True).stdout
    (out / "tc_gemm.sass").write_text(sass)
    for name, pat in [("HGMMA", r"\bHGMMA\b"), ("UTMALDG", r"\bUTMALDG\b"), ("UTMASTG", r"\bUTMASTG\b"),
                      ("SYNCS", r"\bSYNCS\b"), ("USETMAXREG", r"\bUSETMAXREG\b"), ("HMMA", r"\bHMMA\b"), ("LDSM", r"\bLDSM\b"), ("LDGSTS", r"\bLDGSTS\b"), ("BAR", r"\bBAR\b"),
                      ("DEPBAR", r"\bDEPBAR\b"), ("IMAD", r"\bIMAD\b"), ("IADD3", r"\bIADD3\b"), ("LOP3", r"\bLOP3\b"),
                      ("SHF", r"\bSHF\b"), ("LEA", r"\bLEA\b"), ("LDL", r"\bLDL\b"), ("STL", r"\bSTL\b"),
                      ("all", r"^\s+/\*[0-9a-f]{4,}\*/")]:
        print(f"{name:8s} {len(re.findall(pat, sass, re.M))}")


if __name__ == "__main__":
    main()
