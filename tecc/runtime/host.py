"""The host side of a compiled module: what to check, allocate and launch, without kernel bodies.

`HostProgram` is what the manifest stores and what both executors (CUDA and the SIMT emulator)
run: the user-visible signature, temporary buffers, each kernel's parameters and launch
dimensions (expressions over size variables), and the launch sequence.

Argument binding (`bind_arguments`) checks each array against its buffer: count, dtype, rank,
every dimension (binding size variables on first sight and checking them after), and strides
(contiguity, or binding stride variables). Errors name the kernel module, the argument and the
dimension.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..ir import dtype as dt
from ..ir.dtype import DType
from ..ir.errors import DTypeError, ShapeError, TeccError
from ..ir.evaluate import evaluate_int
from ..ir.expr import Expr, Var, const_int, free_vars
from ..ir.index_checks import CheckSite, index_check_sites
from ..ir.serialize import (
    VarTable,
    expr_to_json,
    param_from_json,
    param_to_json,
)
from ..ir.stmt import Buffer, BufferStore, KernelParam, Module, TensorStore, iter_stmts, launch_dims, tensor_maps
from .tensor_map import TensorMapSpec

# Largest grid dimensions of CUDA (compute capability >= 3.0).
MAX_GRID = (2**31 - 1, 65535, 65535)


@dataclass(frozen=True)
class KernelInfo:
    """One kernel as the host sees it: entry name, parameters in ABI order, launch dimensions."""

    name: str
    params: tuple[KernelParam, ...]
    grid: tuple[Expr, Expr, Expr]
    block: tuple[int, int, int]
    dynamic_smem: int = 0
    # by-value tensor maps after `params`, in this order (tensor_map.py; TMA copies)
    tensor_maps: tuple[TensorMapSpec, ...] = ()
    # the cubin's function that runs this kernel: "" for its own; another kernel's name when
    # the code is that kernel's up to names, compiled once (tecc/codegen/twins.py)
    entry: str = ""

    @property
    def function(self) -> str:
        """The name of the cubin's function that runs this kernel."""
        return self.entry or self.name


@dataclass(frozen=True)
class Call:
    """Launch kernel `kernel` with the module-level parameters/temporaries named in `args`."""

    kernel: str
    args: tuple[str, ...]


@dataclass(frozen=True)
class HostProgram:
    name: str
    params: tuple[KernelParam, ...]
    temps: tuple[Buffer, ...]
    kernels: tuple[KernelInfo, ...]
    calls: tuple[Call, ...]
    outputs: tuple[str, ...]
    # the data-dependent index checks of the kernels, numbered as the device's error record
    # names them (tecc/ir/index_checks.py; docs/runtime.md, "Data-dependent indices")
    index_checks: tuple[CheckSite, ...] = ()

    @functools.cached_property
    def buffer_params(self) -> tuple[Buffer, ...]:
        return tuple(p for p in self.params if isinstance(p, Buffer))

    @functools.cached_property
    def size_vars(self) -> tuple[Var, ...]:
        return tuple(p for p in self.params if isinstance(p, Var))

    def kernel(self, name: str) -> KernelInfo:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(name)

    @staticmethod
    def from_module(module: Module, dynamic_smem: Mapping[str, int] | None = None) -> "HostProgram":
        kernels = []
        written: set[str] = set()
        for k in module.kernels:
            dims = launch_dims(k)
            maps = tuple(TensorMapSpec(m.buffer.name, m.buffer.dtype, m.box, m.swizzle, m.merge) for m in tensor_maps(k))
            kernels.append(KernelInfo(k.name, k.params, dims.grid, dims.block, (dynamic_smem or {}).get(k.name, 0),
                                      maps))
        for call in module.calls:
            func = module.kernel(call.kernel)
            by_param = {id(p): a for p, a in zip(func.params, call.args)}
            for s in iter_stmts(func.body):
                # a global buffer is written by plain stores and by TMA tile stores (the staged
                # epilogue's only writes): both make it an output the host copies back
                target = (s.buffer if isinstance(s, BufferStore) else s.map.buffer if isinstance(s, TensorStore)
                          else None)
                if target is not None and target.scope == "global":
                    arg = by_param.get(id(target))
                    written.add(arg.name if arg is not None else target.name)
        calls = tuple(Call(c.kernel, tuple(a.name for a in c.args)) for c in module.calls)
        outputs = tuple(p.name for p in module.params if isinstance(p, Buffer) and p.name in written)
        return HostProgram(module.name, module.params, module.temps, tuple(kernels), calls, outputs,
                           index_check_sites(module.kernels))

    def with_entries(self, entries: Mapping[str, str]) -> "HostProgram":
        """The program with kernel `k` run by the cubin's function `entries[k]` (KernelInfo.entry)."""
        if not entries:
            return self
        kernels = tuple(dataclasses.replace(k, entry=entries.get(k.name, k.entry)) for k in self.kernels)
        return dataclasses.replace(self, kernels=kernels)

    # ---- manifest JSON ------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "params": [param_to_json(p) for p in self.params],
            "temps": [param_to_json(t) for t in self.temps],
            "kernels": [
                {
                    "name": k.name,
                    "params": [param_to_json(p) for p in k.params],
                    "grid": [expr_to_json(g) for g in k.grid],
                    "block": list(k.block),
                    "dynamic_smem": k.dynamic_smem,
                    **({"tensor_maps": [m.to_json() for m in k.tensor_maps]} if k.tensor_maps else {}),
                    **({"entry": k.entry} if k.entry else {}),
                }
                for k in self.kernels
            ],
            "calls": [{"kernel": c.kernel, "args": list(c.args)} for c in self.calls],
            "outputs": list(self.outputs),
            **({"index_checks": [c.to_json() for c in self.index_checks]} if self.index_checks else {}),
        }

    @staticmethod
    def from_json(j: Mapping[str, Any]) -> "HostProgram":
        table = VarTable()
        # a parameter's JSON (its repr) -> what it decodes to: the kernels' parameters repeat the
        # program's arrays and temporaries (a whole-graph program: 3213 parameters, 1131 distinct),
        # each decoded once (the runtime reads a buffer's fields and name, never its identity)
        decoded: dict[str, Buffer | Var] = {}

        def param(p: dict[str, Any]) -> Buffer | Var:
            key = repr(p)
            found = decoded.get(key)
            if found is None:
                found = decoded[key] = param_from_json(p, table)
            return found

        params = tuple(param(p) for p in j["params"])
        temps = tuple(param(t) for t in j["temps"])
        kernels = tuple(
            KernelInfo(
                k["name"],
                tuple(param(p) for p in k["params"]),
                tuple(table.expr(g) for g in k["grid"]),  # type: ignore[arg-type]
                tuple(k["block"]),  # type: ignore[arg-type]
                k.get("dynamic_smem", 0),
                tuple(TensorMapSpec.from_json(m) for m in k.get("tensor_maps", ())),
                str(k.get("entry", "")),
            )
            for k in j["kernels"]
        )
        calls = tuple(Call(c["kernel"], tuple(c["args"])) for c in j["calls"])
        checks = tuple(CheckSite.from_json(c) for c in j.get("index_checks", ()))
        return HostProgram(j["name"], params, temps, kernels, calls, tuple(j["outputs"]), checks)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ArrayInfo:
    """What binding needs to know of an argument: shape, strides in elements, dtype."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: DType


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out: list[int] = []
    acc = 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(out))


def is_contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Row-major contiguous, ignoring the strides of size-1 dimensions (they are never used)."""
    if any(s == 0 for s in shape):
        return True
    expected = contiguous_strides(shape)
    return all(n == 1 or a == b for n, a, b in zip(shape, strides, expected))


def bind_arguments(prog: HostProgram, infos: Sequence[ArrayInfo]) -> dict[Var, int]:
    """Check `infos` against the program's buffer parameters and return the value of every size
    and stride variable. Raises ShapeError / DTypeError naming the argument and dimension."""
    buffers = prog.buffer_params
    if len(infos) != len(buffers):
        names = ", ".join(b.name for b in buffers)
        raise TeccError(f"{prog.name} takes {len(buffers)} arrays ({names}), got {len(infos)}")
    env: dict[Var, int] = {}
    pending: list[tuple[str, Expr, int]] = []
    for pos, (buf, info) in enumerate(zip(buffers, infos)):
        where = f"argument {pos} ({buf.name}) of {prog.name}"
        if info.dtype != buf.dtype:
            raise DTypeError(f"{where}: expected {buf.dtype.name}, got {info.dtype.name}")
        if len(info.shape) != buf.ndim:
            raise ShapeError(
                f"{where}: expected {buf.ndim} dimensions [{', '.join(str(s) for s in buf.shape)}], "
                f"got shape {tuple(info.shape)}"
            )
        for d, (want, got) in enumerate(zip(buf.shape, info.shape)):
            _bind_dim(env, pending, f"{where}, dimension {d}", want, int(got))
        if buf.strides is None:
            if not is_contiguous(info.shape, info.strides):
                raise ShapeError(
                    f"{where}: expected a contiguous row-major array, got strides {tuple(info.strides)} "
                    f"(elements) for shape {tuple(info.shape)}; pass a contiguous copy or declare the "
                    f"placeholder with strides='any'"
                )
        else:
            for d, (want, got) in enumerate(zip(buf.strides, info.strides)):
                _bind_dim(env, pending, f"{where}, stride {d}", want, int(got))
    for where, want, got in pending:
        value = evaluate_int(want, env)
        if value != got:
            raise ShapeError(f"{where}: expected {want} = {value}, got {got}")
    for buf, info in zip(buffers, infos):
        _check_int32_offsets(prog.name, buf, info)
    for v, value in env.items():
        if v.dtype == dt.int32 and not (-(2**31) <= value < 2**31):
            raise ShapeError(
                f"{prog.name}: {v.name} = {value} does not fit the kernel's int32 index; "
                f"declare it tc.var({v.name!r}, 'int64')"
            )
    for temp in prog.temps:
        _check_int32_temporary(prog.name, temp, env)
    return env


def _check_int32_temporary(module: str, buf: Buffer, env: Mapping[Var, int]) -> None:
    """A temporary whose sizes are all int32 is indexed with 32-bit offsets as the arguments are
    (`_check_int32_offsets`), and the kernel that writes it counts its elements in int32: at 2^31
    elements or more both wrap (a (B, H, S, S) score buffer at B·H·S² = 2^31 was written nowhere)."""
    if not _indexed_in_int32(tuple(buf.shape), buf):
        return
    count = _product([max(n, 0) for n in temp_shape(buf, env)])
    if count >= 2**31:
        raise ShapeError(
            f"{module}: the temporary {buf.name} [{', '.join(str(s) for s in buf.shape)}] would hold {count} "
            f"elements at these sizes, more than 32-bit indexing reaches; declare {_size_names(buf.shape)} with "
            f"tc.var(name, 'int64') so the kernels use 64-bit offsets (or plan the program so that it "
            f"needs no such buffer: the explain() of its build says why it has one)"
        )


def _check_int32_offsets(module: str, buf: Buffer, info: ArrayInfo) -> None:
    """Kernels index a buffer whose sizes are all int32 with 32-bit offsets (the emitter's rule);
    an array whose largest offset does not fit would be read at wrapped addresses."""
    exprs = tuple(buf.shape) + tuple(buf.strides or ())
    if not _indexed_in_int32(exprs, buf) or any(s == 0 for s in info.shape):
        return
    largest = sum((n - 1) * abs(st) for n, st in zip(info.shape, info.strides))
    if largest >= 2**31:
        raise ShapeError(
            f"{module}: argument {buf.name} spans {largest + 1} elements, more than 32-bit indexing "
            f"reaches; declare {_size_names(exprs) or 'its sizes'} with tc.var(name, 'int64') so the kernel "
            f"uses 64-bit offsets"
        )


def _indexed_in_int32(exprs: tuple[Expr, ...], buf: Buffer) -> bool:
    """Whether the kernels index `buf` with 32-bit offsets (the emitter's rule): none of its sizes
    and strides (`exprs`) is int64, and its sizes are not constants of 2^31 elements or more (the
    emitter then uses 64-bit offsets)."""
    if any(e.dtype == dt.int64 for e in exprs):
        return False
    static = [const_int(e) for e in buf.shape]
    return not (all(c is not None for c in static) and _product(static) >= 2**31)  # type: ignore[arg-type]


def _size_names(exprs: Sequence[Expr]) -> str:
    """The size variables of `exprs`, sorted and comma-separated ('' for none)."""
    return ", ".join(sorted({v.name for e in exprs for v in free_vars(e)}))


def _product(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _bind_dim(env: dict[Var, int], pending: list[tuple[str, Expr, int]], where: str, want: Expr, got: int) -> None:
    c = const_int(want)
    if c is not None:
        if c != got:
            raise ShapeError(f"{where}: expected {c}, got {got}")
        return
    if isinstance(want, Var):
        if want in env:
            if env[want] != got:
                raise ShapeError(
                    f"{where}: {want.name} is {got} here but {env[want]} in an earlier argument; "
                    f"every use of {want.name} must have the same size"
                )
        else:
            env[want] = got
        return
    pending.append((where, want, got))


def resolve_launch(info: KernelInfo, env: Mapping[Var, int], module: str = "") -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Grid and block of a kernel for bound sizes; checks CUDA's grid limits."""
    grid = tuple(evaluate_int(g, env) for g in info.grid)
    for axis, (g, limit) in enumerate(zip(grid, MAX_GRID)):
        if g > limit:
            raise ShapeError(
                f"{module or info.name}: kernel {info.name} needs a grid of {g} blocks in dimension "
                f"{'xyz'[axis]}, over CUDA's limit of {limit}; the problem is too large for this schedule"
            )
    return grid, info.block  # type: ignore[return-value]


def temp_shape(buf: Buffer, env: Mapping[Var, int]) -> tuple[int, ...]:
    return tuple(evaluate_int(s, env) for s in buf.shape)


def temp_bytes(buf: Buffer, env: Mapping[Var, int]) -> int:
    """The bytes a temporary takes for the bound sizes `env`: at least 1, so that even an empty
    one is a valid allocation to pass as a pointer parameter."""
    count = 1
    for n in temp_shape(buf, env):
        count *= max(n, 0)
    return max(count * buf.dtype.bytes, 1)


def needed_vars(exprs: Sequence[Expr]) -> set[Var]:
    out: set[Var] = set()
    for e in exprs:
        out |= free_vars(e)
    return out

