"""The `tecc` command.

    tecc compile FILE.py... [--arch sm_90] [-o DIR] [--dump-ir DIR]   compile every op to .cubin
    tecc run FILE.py... [--target auto|cuda|sim] [--check]            run the ops (and check them)
    tecc check PATH... [-o DIR] [--dump-ir DIR]                       compile and check (the main job)

A file declares its ops in a module-level list `OPS` of `tecc.OpSpec` (see docs/cli.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Sequence

from .compiler.check import OpSpec, run_and_compare
from .ir.errors import TeccError


def _load_ops(path: Path) -> list[OpSpec]:
    spec = importlib.util.spec_from_file_location(f"tecc_user_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise TeccError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ops = getattr(module, "OPS", None)
    if not isinstance(ops, (list, tuple)) or not all(isinstance(o, OpSpec) for o in ops):
        raise TeccError(f"{path} declares no ops: define a module-level list OPS of tecc.OpSpec")
    return list(ops)


def _files(paths: Sequence[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(f for f in p.glob("*.py") if not f.name.startswith("_")))
        elif p.exists():
            out.append(p)
        else:
            raise TeccError(f"no such file or directory: {p}")
    return out


def _gpu() -> bool:
    from .compiler import gpu_available

    return gpu_available()


def cmd_compile(args: argparse.Namespace, check: bool) -> int:
    from .compiler.build import build

    out_dir = Path(args.output) if args.output else None
    use_gpu = _gpu() if check else False
    failures = 0
    for f in _files(args.files):
        for op in _load_ops(f):
            start = time.perf_counter()
            dump = Path(args.dump_ir) / op.name if args.dump_ir else None
            kernel = build(op.args, "cuda", name=op.name, dump_ir=dump, arch=args.arch)
            took = time.perf_counter() - start
            line = f"{op.name:<16} {len(kernel.module.kernels)} kernel(s)  {kernel.arch}  built in {took:.2f} s"
            if out_dir is not None:
                stem = kernel.save(out_dir / op.name)
                line += f"  -> {stem}.cubin"
            print(line)
            if check:
                result = run_and_compare(op, kernel, use_sim=not use_gpu)
                print(f"  check {result}")
                failures += not result.ok
    return 1 if failures else 0


def cmd_run(args: argparse.Namespace) -> int:
    from .compiler.build import build

    target = args.target
    if target == "auto":
        target = "cuda" if _gpu() else "sim"
    failures = 0
    for f in _files(args.files):
        for op in _load_ops(f):
            kernel = build(op.args, target, name=op.name)
            result = run_and_compare(op, kernel, use_sim=target == "sim")
            print(result if args.check else f"{op.name} ran on {target}")
            failures += args.check and not result.ok
    return 1 if failures else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tecc", description="tecc: a tensor-expression compiler for NVIDIA GPUs")
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext in (("compile", "compile every op of the files to .cubin"),
                           ("check", "compile every op and check it against NumPy (GPU if present, else the emulator)")):
        c = sub.add_parser(name, help=helptext)
        c.add_argument("files", nargs="+", help="Python files (or directories of them) that define OPS")
        c.add_argument("--arch", default=None, help="e.g. sm_90 (default: the live GPU, else sm_90)")
        c.add_argument("-o", "--output", default=None, help="directory for .cubin/.ptx/.cu/.json artifacts")
        c.add_argument("--dump-ir", default=None, help="directory for the IR after every pass")
    r = sub.add_parser("run", help="run the ops of the files")
    r.add_argument("files", nargs="+")
    r.add_argument("--target", choices=("auto", "cuda", "sim"), default="auto")
    r.add_argument("--check", action="store_true", help="compare every output with the NumPy reference")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "compile":
            return cmd_compile(args, check=False)
        if args.command == "check":
            return cmd_compile(args, check=True)
        return cmd_run(args)
    except TeccError as exc:
        print(f"tecc: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
