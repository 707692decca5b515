"""The profiling hook: `with tc.profile() as p:` records every kernel launch made inside it.

    with tc.profile() as p:
        f(a, b, c)                 # a built Kernel, a loaded artifact, or f.sim(...)
    p.table()                      # prints one row per launch (and returns the text)
    p.launches[0].gbps             # the records themselves

Per launch: module, kernel, grid, block, time, bytes moved, FLOPs, achieved GB/s and TFLOP/s.

- **Time.** On the GPU a pair of CUDA events is recorded around each launch on the executor's
  stream and the end event is waited for, so the time is the kernel's own (no copies, no launch
  overhead beyond the driver's), at the price of one synchronization per launch while profiling.
  In the emulator it is the wall time of the simulated launch (useful only to compare emulator runs).
- **Bytes moved** is the size of every buffer parameter of the kernel (arguments and
  temporaries), counted once, as if each were read or written exactly once: the compulsory
  DRAM traffic. Caches make the real traffic lower for re-read inputs, tiling makes it higher
  for naive kernels; Nsight Compute measures it exactly.
- **FLOPs** are counted from the kernel's loop IR when it is known (a Kernel built in this
  process): each floating-point arithmetic operation (+ − × ÷, min/max, math calls count one)
  in a stored value, times the iterations of the loops around it; a guard `if idx < E` limits
  the count to E, other conditions count as taken (an upper bound). Loaded artifacts carry no
  IR, so their FLOPs are None (and so is TFLOP/s).

How it hooks in: while at least one profile is active, `CudaExecutor._launch` (the one place
that launches a kernel) and the emulator's `simulate_kernel` are wrapped, and `Kernel.__call__`
/ `Kernel.sim` note which module is running so launches find their IR. Leaving the last
profile restores them. Profiles nest; each active one records every launch.
"""

from __future__ import annotations

import contextvars
import functools
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from ..ir.evaluate import evaluate_int
from ..ir.expr import Binary, Call, Cast, Compare, Expr, Not, Select, Var
from ..ir.stmt import (
    Allocate,
    Buffer,
    BufferStore,
    For,
    IfThenElse,
    LetStmt,
    PrimFunc,
    Seq,
    Stmt,
)


@dataclass(frozen=True)
class LaunchProfile:
    """One kernel launch as a profile saw it. `time_ms` is None when it could not be timed."""

    module: str
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    time_ms: float | None
    bytes: int | None
    flops: int | None
    target: str  # "cuda" or "sim"
    dynamic_smem: int = 0

    @property
    def gbps(self) -> float | None:
        if not self.time_ms or self.bytes is None:
            return None
        return self.bytes / (self.time_ms * 1e-3) / 1e9

    @property
    def tflops(self) -> float | None:
        if not self.time_ms or self.flops is None:
            return None
        return self.flops / (self.time_ms * 1e-3) / 1e12


@dataclass
class Profile:
    """What `tc.profile()` yields: the launches recorded while it was active."""

    launches: list[LaunchProfile] = field(default_factory=list)

    @property
    def total_ms(self) -> float:
        return sum(r.time_ms or 0.0 for r in self.launches)

    def rows(self) -> list[dict[str, Any]]:
        return [{"module": r.module, "kernel": r.kernel, "target": r.target, "grid": r.grid, "block": r.block,
                 "time_ms": r.time_ms, "bytes": r.bytes, "flops": r.flops, "gbps": r.gbps, "tflops": r.tflops}
                for r in self.launches]

    def table(self, *, print_it: bool = True) -> str:
        """The launches as a table (printed unless print_it=False); returns its text."""
        header = ("kernel", "target", "grid", "block", "time", "bytes", "FLOPs", "GB/s", "TFLOP/s")
        body = [(f"{r.module}:{r.kernel}" if r.module != r.kernel else r.kernel, r.target, _dims(r.grid),
                 _dims(r.block), _ms(r.time_ms), _count(r.bytes, "B"), _count(r.flops, ""),
                 _num(r.gbps, 1), _num(r.tflops, 3)) for r in self.launches]
        body.append(("total", "", "", "", _ms(self.total_ms), "", "", "", ""))
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                 for row in [header, *body]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        text = "\n".join(lines)
        if print_it:
            print(text)
        return text

    def __str__(self) -> str:
        return self.table(print_it=False)


def _dims(d: tuple[int, ...]) -> str:
    return "x".join(str(x) for x in d)


def _ms(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t * 1e3:.1f} us" if t < 1 else f"{t:.3f} ms"


def _count(n: int | None, unit: str) -> str:
    if n is None:
        return "-"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.2f} {prefix}{unit}".rstrip()
    return f"{n} {unit}".rstrip()


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


# ---- FLOP and byte counting -------------------------------------------------------------------

_FLOAT_BINARY = {"+", "-", "*", "/", "min", "max", "fmin", "fmax", "pow"}


def expr_flops(e: Expr) -> int:
    """Floating-point operations in one evaluation of `e` (loads, casts and index math are free)."""
    n = 0
    stack = [e]
    while stack:
        x = stack.pop()
        if isinstance(x, Binary):
            if x.op in _FLOAT_BINARY and x.dtype.is_float:
                n += 1
            stack += [x.a, x.b]
        elif isinstance(x, Call):
            if x.dtype.is_float:
                n += 1
            stack += list(x.args)
        elif isinstance(x, Select):
            stack += [x.cond, x.a, x.b]
        elif isinstance(x, (Cast, Not)):
            stack.append(x.a)
        elif isinstance(x, Compare):
            stack += [x.a, x.b]
        # BufferLoad indices are integer math: not counted
    return n


def kernel_flops(func: PrimFunc, env: Mapping[Var, int]) -> int | None:
    """FLOPs of one launch of `func` with its size variables bound by `env` (None if an extent
    cannot be evaluated)."""
    try:
        return int(_stmt_flops(func.body, dict(env), 1))
    except Exception:  # noqa: BLE001 - an extent over a variable we do not know: give up
        return None


def _stmt_flops(s: Stmt, env: dict[Var, int], mult: int) -> int:
    if isinstance(s, Seq):
        return sum(_stmt_flops(x, env, mult) for x in s.stmts)
    if isinstance(s, For):
        return _stmt_flops(s.body, env, mult * max(evaluate_int(s.extent, env), 0))
    if isinstance(s, IfThenElse):
        guarded = mult
        c = s.cond
        if isinstance(c, Compare) and c.op == "<" and isinstance(c.a, Var):
            try:
                guarded = min(mult, max(evaluate_int(c.b, env), 0))
            except Exception:  # noqa: BLE001 - the bound depends on loop variables: count as taken
                pass
        n = _stmt_flops(s.then_case, env, guarded)
        if s.else_case is not None:
            n += _stmt_flops(s.else_case, env, mult)
        return n
    if isinstance(s, (LetStmt, Allocate)):
        return _stmt_flops(s.body, env, mult)
    if isinstance(s, BufferStore):
        return mult * expr_flops(s.value)
    return 0


def buffer_bytes(buf: Buffer, env: Mapping[Var, int]) -> int:
    n = 1
    for d in buf.shape:
        n *= max(evaluate_int(d, env), 0)
    return n * buf.dtype.bytes


def params_bytes(params: Any, env: Mapping[Var, int]) -> int | None:
    try:
        return sum(buffer_bytes(p, env) for p in params if isinstance(p, Buffer) and p.scope == "global")
    except Exception:  # noqa: BLE001
        return None


# ---- the hooks --------------------------------------------------------------------------------

_ACTIVE: list[Profile] = []
_CURRENT_MODULE: contextvars.ContextVar[Any] = contextvars.ContextVar("tecc_profile_module", default=None)
_SAVED: dict[str, Any] = {}


def _record(r: LaunchProfile) -> None:
    for p in _ACTIVE:
        p.launches.append(r)


def _install() -> None:
    from ..runtime import cuda as rt_cuda
    from ..runtime.sim import executor as sim_executor
    from .kernel import Kernel

    _SAVED["cuda_launch"] = rt_cuda.CudaExecutor._launch
    _SAVED["simulate_kernel"] = sim_executor.simulate_kernel
    _SAVED["kernel_call"] = Kernel.__call__
    _SAVED["kernel_sim"] = Kernel.sim

    orig_launch = _SAVED["cuda_launch"]

    @functools.wraps(orig_launch)
    def launch(self: Any, info: Any, grid: Any, block: Any, params: Any) -> Any:
        if not _ACTIVE:
            return orig_launch(self, info, grid, block, params)
        from cuda.core import EventOptions  # type: ignore[import-untyped]

        timing = EventOptions(timing_enabled=True)
        start = self.stream.record(options=timing)
        result = orig_launch(self, info, grid, block, params)
        end = self.stream.record(options=timing)
        end.sync()
        elapsed = float(end - start)
        env = {p: int(v) for p, v in zip(info.params, params) if isinstance(p, Var)}
        module = _CURRENT_MODULE.get()
        func = _find_kernel(module, info.name)
        flops = kernel_flops(func, env) if func is not None else None
        _record(LaunchProfile(self.host.name, info.name, tuple(grid), tuple(block), elapsed,
                              params_bytes(info.params, env), flops, "cuda", info.dynamic_smem))
        return result

    orig_sim = _SAVED["simulate_kernel"]

    @functools.wraps(orig_sim)
    def simulate(func: PrimFunc, args: Mapping[str, Any], grid: Any, block: Any, **kw: Any) -> Any:
        if not _ACTIVE:
            return orig_sim(func, args, grid, block, **kw)
        t0 = time.perf_counter()
        result = orig_sim(func, args, grid, block, **kw)
        elapsed = (time.perf_counter() - t0) * 1e3
        env = {p: int(args[p.name]) for p in func.params if isinstance(p, Var) and p.name in args}
        nbytes = sum(int(getattr(args.get(p.name), "nbytes", 0)) for p in func.params
                     if isinstance(p, Buffer) and p.scope == "global")
        module = _CURRENT_MODULE.get()
        _record(LaunchProfile(module.name if module is not None else func.name, func.name, tuple(grid),
                              tuple(block), elapsed, nbytes, kernel_flops(func, env), "sim"))
        return result

    orig_call, orig_ksim = _SAVED["kernel_call"], _SAVED["kernel_sim"]

    @functools.wraps(orig_call)
    def kernel_call(self: Any, *args: Any) -> Any:
        token = _CURRENT_MODULE.set(self.module)
        try:
            return orig_call(self, *args)
        finally:
            _CURRENT_MODULE.reset(token)

    @functools.wraps(orig_ksim)
    def kernel_sim(self: Any, *args: Any) -> Any:
        token = _CURRENT_MODULE.set(self.module)
        try:
            return orig_ksim(self, *args)
        finally:
            _CURRENT_MODULE.reset(token)

    rt_cuda.CudaExecutor._launch = launch  # type: ignore[method-assign]
    sim_executor.simulate_kernel = simulate  # type: ignore[assignment]
    Kernel.__call__ = kernel_call  # type: ignore[method-assign]
    Kernel.sim = kernel_sim  # type: ignore[method-assign]


def _uninstall() -> None:
    from ..runtime import cuda as rt_cuda
    from ..runtime.sim import executor as sim_executor
    from .kernel import Kernel

    rt_cuda.CudaExecutor._launch = _SAVED.pop("cuda_launch")  # type: ignore[method-assign]
    sim_executor.simulate_kernel = _SAVED.pop("simulate_kernel")
    Kernel.__call__ = _SAVED.pop("kernel_call")  # type: ignore[method-assign]
    Kernel.sim = _SAVED.pop("kernel_sim")  # type: ignore[method-assign]


def _find_kernel(module: Any, name: str) -> PrimFunc | None:
    if module is None:
        return None
    for k in module.kernels:
        if k.name == name:
            return k
    return None


@contextmanager
def profile() -> Iterator[Profile]:
    """Record every kernel launch made inside the block (GPU and emulator); see the module doc."""
    p = Profile()
    if not _ACTIVE:
        _install()
    _ACTIVE.append(p)
    try:
        yield p
    finally:
        _ACTIVE.remove(p)
        if not _ACTIVE:
            _uninstall()


__all__ = ["profile", "Profile", "LaunchProfile", "kernel_flops", "expr_flops"]
