"""The `tecc` command (docs/cli.md).

    tecc compile FILE.py... [--arch sm_90] [-o DIR] [--dump-ir DIR] [--tune] [--plan FILE.json]
                                                                                compile every op to .cubin
    tecc check   PATH...   [--arch sm_90] [-o DIR] [--dump-ir DIR]            compile and check against NumPy
    tecc run     FILE.py... [--target auto|cuda|sim] [--check] [--profile]     run the ops (check, profile)
    tecc explain FILE.py... [--arch sm_90] [--plan FILE.json]                   how each op was scheduled
    tecc tune    FILE.py... [--arch sm_90] [--top-k N]                          autotune on the GPU (docs/tuning.md)
    tecc cache   info | clear [--tuning]                                        the compile and build caches

A file declares its ops in a module-level list `OPS` of `tecc.OpSpec`. The CLI only calls the
compiler (`tecc.compiler`), never the runtime directly.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import textwrap
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

from .compiler.check import OpSpec, run_and_compare
from .ir.errors import ScheduleError, TeccError

EXIT_FAIL = 1   # a check failed
EXIT_ERROR = 2  # tecc could not do what was asked (bad file, compile error, no GPU, ...)


class UsageError(TeccError):
    """A problem with the command line or the user's file, reported without a traceback."""


# ---- the user's files -------------------------------------------------------------------------

# the files whose code tecc ran: an exception raised there is the user's to fix (see main)
_USER_FILES: set[Path] = set()


def _load_ops(path: Path) -> list[OpSpec]:
    _USER_FILES.add(path.resolve())
    # as `python path` does: the file's folder first on the import path, so that it can import the
    # modules next to it (and its reference can, later, when the op is checked)
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(f"tecc_user_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except TeccError as exc:
        raise UsageError(f"{path} raised {type(exc).__name__} while defining its ops: {exc}") from exc
    except SyntaxError as exc:
        raise UsageError(f"{path} is not valid Python: {exc.msg} at line {exc.lineno}") from exc
    except Exception as exc:  # noqa: BLE001 - any error in the user's file is theirs to fix
        line = _user_line(exc, path)
        raise UsageError(f"importing {path} failed{line}: {type(exc).__name__}: {exc}. "
                         "Fix the file (run it with python to see the traceback), then run tecc again") from exc
    ops = getattr(module, "OPS", None)
    if not isinstance(ops, (list, tuple)) or not all(isinstance(o, OpSpec) for o in ops):
        raise UsageError(f"{path} declares no ops: define a module-level list OPS of tecc.OpSpec, e.g. "
                         "OPS = [tc.OpSpec('matmul', [A, B, C], lambda a, b: a @ b, sizes={'M': 100})] "
                         "(see docs/cli.md)")
    names = [o.name for o in ops]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise UsageError(f"{path} declares several ops named {', '.join(dups)}; op names must be unique "
                         "(they name the artifacts)")
    return list(ops)


def _raised_by_user_code(exc: BaseException) -> tuple[Path, int] | None:
    """(file, line) when `exc` was raised by code of a user's file (an op's reference,
    make_inputs, or a function it calls) rather than inside tecc: the innermost frame of a
    user's file is deeper than the innermost frame of tecc's own package."""
    package = Path(__file__).resolve().parent
    user: tuple[int, Path, int] | None = None
    tecc_depth = -1
    for depth, frame in enumerate(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename).resolve()
        if path in _USER_FILES:
            user = (depth, path, frame.lineno or 0)
        elif path.is_relative_to(package):
            tecc_depth = depth
    if user is None or user[0] < tecc_depth:
        return None
    return user[1], user[2]


def _under(directory: Path, name: str) -> Path:
    """directory/name, refusing a name that would lead outside `directory` (OpSpec names are
    checked when declared; this guards what is written)."""
    path = directory / name
    if path.resolve().parent != directory.resolve():
        raise UsageError(f"op name {name!r} would write outside {directory}; name ops with letters, digits and _")
    return path


def _output_directory(given: str | None) -> Path | None:
    """`-o DIR`, created now (before any op is compiled), or a UsageError saying why it cannot be."""
    if not given:
        return None
    directory = Path(given)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"-o {directory}: it is a file, not a directory; give -o a directory to write the "
                         "artifacts into (it is created if missing)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"-o {directory}: cannot create that directory ({exc.strerror or exc}); give -o a "
                         "directory that can be created and written") from exc
    return directory


def _save(kernel: Any, stem: Path) -> Path:
    """kernel.save(stem), with a disk error (unwritable, full) as a UsageError."""
    try:
        return Path(kernel.save(stem))
    except OSError as exc:
        raise UsageError(f"cannot write the artifact {stem}.cubin/.json ({exc.strerror or exc}); give -o a "
                         "directory that can be written") from exc


def _user_line(exc: BaseException, path: Path) -> str:
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if Path(frame.filename).resolve() == path.resolve():
            return f" at line {frame.lineno}"
    return ""


def _files(paths: Sequence[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.glob("*.py") if not f.name.startswith("_"))
            if not found:
                raise UsageError(f"{p} is a directory with no Python files (files starting with _ are skipped)")
            out.extend(found)
        elif p.exists():
            out.append(p)
        else:
            raise UsageError(f"no such file or directory: {p}")
    return out


def _all_ops(paths: Sequence[str]) -> list[tuple[Path, OpSpec]]:
    return [(f, op) for f in _files(paths) for op in _load_ops(f)]


def _gpu() -> bool:
    from .compiler import gpu_available

    return gpu_available()


# ---- progress ---------------------------------------------------------------------------------

class _Progress:
    """A rich progress bar on stderr that appears only when the work takes over `delay` seconds
    and stderr is a terminal (TECC_PROGRESS=1 forces it, 0 hides it). `advance(label)` after
    each item; plain print() still works while the bar shows (rich redirects it above the bar)."""

    def __init__(self, total: int, description: str, delay: float = 1.0) -> None:
        from .compiler import options as knobs

        forced = knobs.progress_bars()
        self.enabled = forced if forced is not None else sys.stderr.isatty()
        self.total, self.description, self.delay = total, description, delay
        self._progress: Any = None
        self._task: Any = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._done = 0
        self._label = ""
        self._started = False

    def __enter__(self) -> "_Progress":
        if self.enabled and self.total > 0:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[label]}"), TimeElapsedColumn(),
                                      console=Console(stderr=True), transient=True)
            self._task = self._progress.add_task(self.description, total=self.total, label="")
            self._timer = threading.Timer(self.delay, self._start)
            self._timer.daemon = True
            self._timer.start()
        return self

    def _start(self) -> None:
        with self._lock:
            if self._progress is not None and self._done < self.total:
                self._progress.update(self._task, completed=self._done, label=self._label)
                self._progress.start()
                self._started = True

    def working_on(self, label: str) -> None:
        with self._lock:
            self._label = label
            if self._progress is not None:
                self._progress.update(self._task, label=label)

    def advance(self) -> None:
        with self._lock:
            self._done += 1
            if self._progress is not None:
                self._progress.update(self._task, completed=self._done)

    def __exit__(self, *exc: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            if self._progress is not None and self._started:
                self._progress.stop()
            self._progress = None


# ---- commands ---------------------------------------------------------------------------------

def _plans(args: argparse.Namespace, ops: Sequence[tuple[Path, OpSpec]]) -> dict[str, tuple[Any, str]]:
    """--plan FILE.json: the plan of each op, by op name, with where it came from (for errors).
    The file holds one plan (as `f.plan` writes it, or an artifact manifest `path.json`, whose
    "plan" is used) for a command over one op, or an object mapping op names to plans."""
    given = getattr(args, "plan", None)
    if not given:
        return {}
    path = Path(given)
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"--plan {path}: cannot read it ({exc.strerror or exc})") from exc
    except json.JSONDecodeError as exc:
        raise UsageError(f"--plan {path}: not JSON ({exc.msg} at line {exc.lineno}); write a plan as "
                         "`f.plan.to_json()` gives it, or an object mapping op names to plans") from exc
    where = f"--plan {path}"
    if isinstance(doc, dict) and isinstance(doc.get("plan"), dict) and "host" in doc:
        where += f" (the plan of op {doc.get('entry')}, from its artifact)"
        doc = doc["plan"]  # an artifact manifest (kernel.save's path.json)
    names = [op.name for _, op in ops]
    if isinstance(doc, dict) and "steps" in doc:
        if len(names) != 1:
            raise UsageError(f"--plan {path} holds one plan, but the files declare {len(names)} ops "
                             f"({', '.join(names)}); give one file with one op, or map op names to plans")
        return {names[0]: (doc, where)}
    if isinstance(doc, dict) and all(isinstance(v, dict) for v in doc.values()):
        unknown = sorted(set(doc) - set(names))
        if unknown:
            raise UsageError(f"--plan {path} names ops the files do not declare: {', '.join(unknown)} "
                             f"(they declare {', '.join(names)})")
        return {name: (plan, f"{where} (its plan for {name})") for name, plan in doc.items()}
    raise UsageError(f"--plan {path}: expected a plan (an object with \"steps\") or an object mapping op "
                     "names to plans")


def _build(op: OpSpec, target: str, args: argparse.Namespace, dump: Path | None = None,
           plans: dict[str, tuple[Any, str]] | None = None) -> Any:
    from .compiler import build

    plan, where = (plans or {}).get(op.name, (None, ""))
    if plan is not None:  # replayed as given (a plan chosen elsewhere: a tuner, another machine)
        try:
            return build(op.args, target, name=op.name, dump_ir=dump, arch=getattr(args, "arch", None), plan=plan)
        except ScheduleError as exc:
            raise UsageError(f"{where} does not schedule op {op.name}: {exc}") from exc
    if getattr(args, "tune", False):  # the winner `tecc tune` just stored, for the op's sizes
        return build(op.args, target, name=op.name, dump_ir=dump, arch=getattr(args, "arch", None),
                     sizes=dict(op.sizes), tune=True)
    return build(op.args, target, name=op.name, dump_ir=dump, arch=getattr(args, "arch", None),
                 allow_tf32=getattr(args, "allow_tf32", False))


def _reused(kernel: Any, misses_before: int) -> tuple[bool, bool, str]:
    """What the build of `kernel` took from earlier builds: (the plan from the build cache, the
    cubin from the compile cache, the words for its line). A compile-cache hit on a binary that
    this build's planning compiled (the planner's ptxas checks) is no reuse: it says so."""
    from .compiler import cache

    steps = [name for name, _ in getattr(kernel.timing, "seconds", [])]
    plan = "build cache hit" in steps
    cubin = "nvrtc (cache hit)" in steps
    said = []
    if plan:
        said.append("plan from the build cache")
    if cubin and cache.STATS.last_hit_compiled_after(misses_before):
        cubin = False
        said.append("cubin compiled once, by the planner's ptxas check")
    elif cubin:
        said.append("cubin from the compile cache")
    return plan, cubin, f" ({', '.join(said)})" if said else ""


def cmd_compile(args: argparse.Namespace, check: bool) -> int:
    out_dir = _output_directory(args.output)
    if getattr(args, "tune", False):
        cmd_tune(args)
        print()
    ops = _all_ops(args.files)
    plans = _plans(args, ops)
    use_gpu = _gpu() if check else False
    from .compiler import cache

    failures = 0
    total_start = time.perf_counter()
    plans_reused = cubins_reused = 0
    width = max([16] + [len(op.name) for _, op in ops])
    with _Progress(len(ops), "check" if check else "compile") as bar:
        for _, op in ops:
            bar.working_on(op.name)
            start = time.perf_counter()
            dump = _under(Path(args.dump_ir), op.name) if args.dump_ir else None
            misses = cache.STATS.misses
            kernel = _build(op, "cuda", args, dump, plans)
            took = time.perf_counter() - start
            plan_reused, cubin_reused, said = _reused(kernel, misses)
            plans_reused += plan_reused
            cubins_reused += cubin_reused
            line = (f"{op.name:<{width}} {len(kernel.module.kernels)} kernel(s)  {kernel.arch}  "
                    f"built in {took:.2f} s{said}")
            if out_dir is not None:
                stem = _save(kernel, _under(out_dir, op.name))
                line += f"  -> {stem}.cubin"
            print(line, flush=True)
            if check:
                result = run_and_compare(op, kernel, use_sim=not use_gpu)
                print(f"  check {result}", flush=True)
                failures += not result.ok
            bar.advance()
    print(f"{len(ops)} op(s) in {time.perf_counter() - total_start:.2f} s; from earlier builds: "
          f"{plans_reused} plan(s) from the build cache, {cubins_reused} cubin(s) from the compile cache"
          + (f", {failures} failed the check" if failures else ""), flush=True)
    return EXIT_FAIL if failures else 0


def cmd_run(args: argparse.Namespace) -> int:
    from .compiler.profiling import profile

    ops = _all_ops(args.files)
    target = args.target
    if target == "auto":
        target = "cuda" if _gpu() else "sim"
    elif target == "cuda" and not _gpu():
        raise UsageError("--target cuda needs a CUDA GPU and none is available here; use --target sim to run "
                         "in the CPU emulator (or --target auto)")
    failures = 0
    with profile() as prof, _Progress(len(ops), f"run on {target}") as bar:
        for _, op in ops:
            bar.working_on(op.name)
            kernel = _build(op, target, args)
            result = run_and_compare(op, kernel, use_sim=target == "sim")
            if args.check:
                print(result, flush=True)
                failures += not result.ok
            else:
                print(f"{op.name} ran on {target}", flush=True)
            bar.advance()
    if args.profile:
        prof.table()
    return EXIT_FAIL if failures else 0


def cmd_explain(args: argparse.Namespace) -> int:
    ops = _all_ops(args.files)
    plans = _plans(args, ops)
    with _Progress(len(ops), "explain") as bar:
        for i, (path, op) in enumerate(ops):
            bar.working_on(op.name)
            kernel = _build(op, "cuda", args, plans=plans)
            if i:
                print()
            print(f"== op {op.name} ({path}) ==\n{kernel.explain()}", flush=True)
            bar.advance()
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from .compiler import tuning

    if not _gpu():
        tuning.require_gpu()  # raises the TeccError that says why and what works without a GPU
    ops = _all_ops(args.files)
    for i, (path, op) in enumerate(ops):
        if i:
            print()
        with _TuneProgress(op.name) as progress:
            result = tuning.tune(op, arch=getattr(args, "arch", None), top_k=args.top_k,
                                ref=tuning.ProgramRef(str(path), op.name), progress=progress)
        win = result.winner
        print(f"{op.name}: {len(result.results)} candidate(s) on {result.device} ({result.problem.arch}) "
              f"in {result.seconds:.1f} s; timing: {result.note}", flush=True)
        print(result.table(), flush=True)
        if win is not None:
            print(f"winner: {win.candidate.label}, median {win.median_us:.1f} us "
                  f"(predicted {win.candidate.predicted_us:.1f} us); stored in {tuning.TuningDB().path}", flush=True)
    return 0


class _TuneProgress:
    """The tuner's progress callback as rich bars: one for compiling, one for measuring."""

    def __init__(self, op: str) -> None:
        self.op = op
        self._bars: dict[str, _Progress] = {}
        self._done: dict[str, int] = {}

    def __enter__(self) -> "_TuneProgress":
        return self

    def __call__(self, phase: str, done: int, total: int, label: str) -> None:
        bar = self._bars.get(phase)
        if bar is None:
            bar = self._bars[phase] = _Progress(total, f"{phase} {self.op}", delay=0.5).__enter__()
            self._done[phase] = 0
        if label:
            bar.working_on(label[:60])
        while self._done[phase] < done:
            bar.advance()
            self._done[phase] += 1
        if done >= total:
            bar.__exit__(None, None, None)

    def __exit__(self, *exc: Any) -> None:
        for bar in self._bars.values():
            bar.__exit__(None, None, None)


def cmd_cache(args: argparse.Namespace) -> int:
    from .compiler import cache

    if args.action == "info":
        print(cache.info())
        stats_path = cache.info().tuning_db
        if stats_path.exists():
            from .compiler.tuning import TuningDB

            s = TuningDB(stats_path).stats()
            print(f"  measurements  {s['measurements']}\n  problems      {s['problems']}")
        return 0
    from .compiler import build_cache

    removed = cache.clear(tuning=args.tuning)
    builds = build_cache.clear()
    print(f"removed {removed} compile-cache entr{'y' if removed == 1 else 'ies'} from {cache.root()}, "
          f"{builds} build-cache entr{'y' if builds == 1 else 'ies'} from {build_cache.root()}"
          + (" and the tuning database" if args.tuning else ""))
    return 0


# ---- the parser -------------------------------------------------------------------------------

_EPILOG = """\
A file declares its ops in a module-level list OPS of tecc.OpSpec:

    import numpy as np, tecc as tc
    M = tc.var("M")
    A = tc.placeholder((M, 256), "float32", name="A")
    B = tc.placeholder((256, 512), "float32", name="B")
    k = tc.reduce_axis(256, name="k")
    C = tc.compute((M, 512), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    OPS = [tc.OpSpec("matmul", [A, B, C], lambda a, b: a @ b, sizes={"M": 100})]

Compiled kernels are cached in TECC_CACHE_DIR (default ~/.cache/tecc); TECC_NO_CACHE=1 bypasses it.
Exit status: 0 success, 1 a check failed, 2 an error (message on stderr). docs/cli.md has more.
"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30, width=100)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tecc", formatter_class=_Formatter, epilog=_EPILOG,
        description="tecc: a tensor-expression compiler for NVIDIA GPUs. Compile the ops a Python file "
                    "declares to .cubin, run and check them on the GPU or in the CPU emulator, and "
                    "manage the compile cache.")
    p.add_argument("--traceback", action="store_true", help="on an error, show the Python traceback too")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def files(c: argparse.ArgumentParser) -> None:
        c.add_argument("files", nargs="+", metavar="FILE",
                       help="Python files (or directories of them) that define OPS")

    def arch(c: argparse.ArgumentParser) -> None:
        c.add_argument("--arch", default=None, metavar="SM",
                       help="target architecture, e.g. sm_90 (default: TECC_ARCH, else the live GPU, else sm_90)")

    for name, helptext in (
            ("compile", "compile every op of the files to .cubin (served from the compile cache when unchanged)"),
            ("check", "compile every op and check it against NumPy (on the GPU if present, else the emulator)")):
        c = sub.add_parser(name, help=helptext, description=helptext, formatter_class=_Formatter)
        files(c)
        arch(c)
        c.add_argument("-o", "--output", default=None, metavar="DIR",
                       help="write DIR/<op>.cubin, .ptx, .cu and .json (the manifest, docs/runtime.md)")
        c.add_argument("--dump-ir", default=None, metavar="DIR", help="write the IR after every pass to DIR/<op>/")
        c.add_argument("--plan", default=None, metavar="FILE.json",
                       help="replay this plan instead of planning (one plan, an artifact's .json, or an object "
                            "mapping op names to plans)")
        if name == "compile":
            c.add_argument("--tune", action="store_true",
                           help="autotune each op first (as `tecc tune`; needs a GPU), then compile the winners")
            c.add_argument("--top-k", type=int, default=8, help="with --tune: candidates to measure")
            c.add_argument("--allow-tf32", action="store_true",
                           help="let the planner run float32 contractions on tensor cores with the operands rounded "
                                "to tf32 (build(..., allow_tf32=True); not with --tune)")

    r = sub.add_parser("run", help="run every op on random inputs (GPU if present, else the emulator)",
                       description="Run every op on random inputs, on the GPU if there is one, else in the "
                                   "CPU emulator; --check compares each output with the NumPy reference.",
                       formatter_class=_Formatter)
    files(r)
    arch(r)
    r.add_argument("--target", choices=("auto", "cuda", "sim"), default="auto",
                   help="where to run (default auto: cuda when a GPU is present)")
    r.add_argument("--check", action="store_true", help="compare every output with the NumPy reference")
    r.add_argument("--profile", action="store_true",
                   help="print a table of every launch: time, bytes, FLOPs, GB/s, TFLOP/s")

    e = sub.add_parser("explain", help="show how each op was scheduled: plan, launch shapes, registers",
                       description="Show how each op was scheduled: the plan and why (the planner's ranking "
                                   "when it chose per kernel, the rewrite's reason otherwise, and any candidate "
                                   "that failed and was skipped), each kernel's grid and block, ptxas's registers "
                                   "and spills.",
                       formatter_class=_Formatter)
    files(e)
    arch(e)
    e.add_argument("--plan", default=None, metavar="FILE.json",
                   help="explain this plan instead of the planner's (one plan, an artifact's .json, or an object "
                        "mapping op names to plans)")
    e.add_argument("--allow-tf32", action="store_true",
                   help="plan as build(..., allow_tf32=True): float32 contractions may use tf32 tensor cores")

    t = sub.add_parser("tune", help="autotune every op and store the winners in the tuning database",
                       description="Compile the planner's top-k candidates of every op, time them on the GPU, "
                                   "check them against NumPy and store all measurements and the winner in the "
                                   "tuning database (TECC_TUNING_DB, else TECC_CACHE_DIR/tuning.sqlite); later builds with "
                                   "tune=True (and `tecc compile --tune`) reuse the winner without measuring. "
                                   "Needs a CUDA GPU.",
                       formatter_class=_Formatter)
    files(t)
    arch(t)
    t.add_argument("--top-k", type=int, default=8, help="candidates to measure per op (default 8)")

    k = sub.add_parser("cache", help="show or empty the compile and build caches",
                       description="Show (info) or empty (clear) the compile cache (NVRTC's output) and the build "
                                   "cache (plans and final loop IR) in TECC_CACHE_DIR.",
                       formatter_class=_Formatter)
    k.add_argument("action", choices=("info", "clear"))
    k.add_argument("--tuning", action="store_true", help="with clear: also delete the tuning database")
    return p


def _paragraph(message: str) -> str:
    """The error as one paragraph: the first line wrapped, any quoted lines (source excerpts) kept."""
    first, _, rest = str(message).strip().partition("\n")
    text = textwrap.fill(first, width=100, subsequent_indent="  ")
    return f"{text}\n{rest}" if rest else text


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "compile":
            return cmd_compile(args, check=False)
        if args.command == "check":
            return cmd_compile(args, check=True)
        if args.command == "run":
            return cmd_run(args)
        if args.command == "explain":
            return cmd_explain(args)
        if args.command == "tune":
            return cmd_tune(args)
        return cmd_cache(args)
    except KeyboardInterrupt:
        print("tecc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `tecc explain ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's flush would fail again)
        return 141  # 128 + SIGPIPE, as a shell reports a process the pipe ended
    except TeccError as exc:
        if args.traceback:
            traceback.print_exc()
        kind = "" if isinstance(exc, UsageError) else f"{type(exc).__name__}: "
        print(_paragraph(f"tecc: error: {kind}{exc}"), file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:  # noqa: BLE001 - a bug in tecc: still one paragraph, traceback on request
        if args.traceback:
            traceback.print_exc()
        user = _raised_by_user_code(exc)
        if user is not None:
            print(_paragraph(f"tecc: error: {user[0].name} raised {type(exc).__name__} at line {user[1]}: {exc}. "
                             "This is an error in that file's code (an op's reference, make_inputs or a "
                             "function they call), not in tecc; fix it (--traceback shows where), then run "
                             "tecc again"), file=sys.stderr)
            return EXIT_ERROR
        print(_paragraph(f"tecc: internal error: {type(exc).__name__}: {exc}. This is a bug in tecc; rerun "
                         "with --traceback and report it with the traceback"), file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
