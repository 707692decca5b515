"""The loop-nest IR: buffers, statements, kernels (PrimFunc) and the kernel module.

Part of tecc.ir.stmt (which re-exports every name here, with the matrix, warpgroup, mbarrier and
TMA statements of their own modules, which build on these). This module is the IR's reference
manual: each node says what it means next to its definition.
Statements are immutable; a pass builds new nodes and keeps unchanged subtrees shared (see
`tecc.ir.visitor.StmtMutator`). Equality of statements is identity; compare printed text
(`str(node)`) for structure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence, Union

from . import dtype as dt
from .dtype import DType
from .errors import DTypeError, ScheduleError, TeccError
from .expr import BufferLoad, Const, Expr, Var, as_expr, const_int, index_expr, size_product, to_shape
from .intrinsics import IntrinsicError, lookup
from .layout import Swizzle
from .printing import to_text

SCOPES = ("global", "shared", "local", "fragment")


@dataclass(frozen=True, eq=False)
class Buffer:
    """A named region of memory of one dtype with a shape and strides, in elements.

    scope:
      'global' -- device memory, a kernel parameter (or a temporary the host allocates);
      'shared' -- one copy per thread block, visible to all its threads (CUDA __shared__);
      'local'  -- one copy per thread (registers, or local memory if indexed dynamically);
      'fragment' -- per-lane registers holding tiles of a warp-collective matrix instruction:
                  `fragment = (intrinsic, operand)` names the row of tecc.ir.intrinsics and the
                  operand ('a', 'b', 'c', 'd') whose layout map says which tile element each
                  lane holds at each position; the buffer is a whole number of such fragments.
    `strides` is None for a row-major contiguous buffer; otherwise one stride per dimension,
    ints or 'stride' variables passed to the kernel. Element (i0, .., in) lives at
    sum(ik * stride_k) elements past the base pointer. `tensor` names the tensor-expression
    stage the buffer holds, so schedule primitives can address it ("C", "C.shared").
    `zero_init` (global temporaries only): the host zeroes the buffer once, when it allocates
    it, and not before later calls that reuse it; every kernel that changes it must leave it
    zero again when it exits (a counter that resets itself, e.g. split_reduce's arrivals)."""

    name: str
    dtype: DType
    shape: tuple[Expr, ...]
    scope: str = "global"
    strides: tuple[Expr, ...] | None = None
    tensor: str = ""
    zero_init: bool = False
    layout: Swizzle | None = None
    fragment: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise TeccError(f"buffer {self.name}: scope must be one of {SCOPES}, got {self.scope!r}")
        object.__setattr__(self, "dtype", dt.as_dtype(self.dtype))
        object.__setattr__(self, "shape", to_shape(self.shape))
        if self.strides is not None:
            strides = tuple(index_expr(s) for s in self.strides)
            if len(strides) != len(self.shape):
                raise TeccError(f"buffer {self.name}: {len(strides)} strides for {len(self.shape)} dimensions")
            object.__setattr__(self, "strides", strides)
        if not self.tensor:
            object.__setattr__(self, "tensor", self.name)
        if self.zero_init and self.scope != "global":
            raise TeccError(f"buffer {self.name}: only a global temporary can be zero-initialised, not {self.scope}")
        if self.layout is not None and self.scope != "shared":
            raise TeccError(f"buffer {self.name}: only a shared buffer can have a layout, not a {self.scope} one")
        if self.layout is not None:
            size = self.static_span()
            if size is not None:
                self.layout.check_fits(self.name, size)
        if (self.scope == "fragment") != (self.fragment is not None):
            raise TeccError(f"buffer {self.name}: a fragment buffer needs fragment=(intrinsic, operand), and only "
                            f"a fragment buffer may have one (scope {self.scope}, fragment {self.fragment})")
        if self.fragment is not None:
            check_fragment_buffer(self)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def row_major_strides(self) -> tuple[Expr, ...]:
        """Strides of a contiguous row-major layout of this shape (found once per buffer: the code
        generator asks at every access)."""
        found: tuple[Expr, ...] | None = self.__dict__.get("_row_major")
        if found is None:
            trailing = list(reversed(self.shape))
            found = tuple(reversed([size_product(trailing[:d]) for d in range(len(trailing))]))
            object.__setattr__(self, "_row_major", found)
        return found

    def effective_strides(self) -> tuple[Expr, ...]:
        return self.strides if self.strides is not None else self.row_major_strides()

    def static_span(self) -> int | None:
        """Elements from the first to one past the last, or None unless shape and strides are constants."""
        shape = [const_int(e) for e in self.shape]
        strides = [const_int(e) for e in self.effective_strides()]
        if any(n is None for n in shape) or any(s is None for s in strides):
            return None
        if 0 in shape:
            return 0
        return 1 + sum((n - 1) * s for n, s in zip(shape, strides) if n is not None and s is not None)

    def __getitem__(self, indices: Any) -> Expr:
        if not isinstance(indices, tuple):
            indices = (indices,)
        return BufferLoad(self, tuple(index_expr(i) for i in indices))

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        shape = ", ".join(str(s) for s in self.shape)
        return f"Buffer({self.name}: {self.scope} {self.dtype}[{shape}])"


def check_fragment_buffer(buf: Buffer) -> None:
    """A fragment buffer names an existing (intrinsic, operand), stores its dtype, is 1-D with a
    constant length that is a whole number of fragments (called by Buffer's constructor)."""
    assert buf.fragment is not None
    name, role = buf.fragment
    operand = lookup(name).operand(role)
    if buf.dtype != operand.dtype:
        raise IntrinsicError(
            f"fragment buffer {buf.name} holds operand {role} of {name}, which is stored as {operand.dtype}, "
            f"but the buffer is {buf.dtype}")
    size = const_int(buf.shape[0]) if len(buf.shape) == 1 else None
    if size is None or size % operand.elements:
        raise IntrinsicError(
            f"fragment buffer {buf.name}: shape [{', '.join(str(s) for s in buf.shape)}] must be one constant "
            f"dimension holding whole fragments of {operand.elements} elements ({name} operand {role})")


class Stmt:
    """Base of statements."""

    def __str__(self) -> str:
        return to_text(self)


# For-loop kinds. A loop's kind says how its iterations run:
#   serial      -- one after another in one thread;
#   unroll      -- like serial, but the emitter asks the compiler to unroll it fully (static extent);
#   vectorize   -- like unroll, and the accesses it makes on its variable are emitted as one
#                  vector access (float4, ...) where contiguous and aligned; otherwise unrolled;
#   blockIdx.*  -- each iteration runs in a different thread block (grid dimension = extent);
#   threadIdx.* -- each iteration runs in a different thread of the block (block dimension).
# A thread- or block-bound loop must start at 0. Several loops may bind the same thread axis:
# the block gets the largest extent and the smaller loops are guarded (`if (threadIdx.x < n)`).
THREAD_KINDS = ("threadIdx.x", "threadIdx.y", "threadIdx.z")
BLOCK_KINDS = ("blockIdx.x", "blockIdx.y", "blockIdx.z")
LOOP_KINDS = ("serial", "unroll", "vectorize") + BLOCK_KINDS + THREAD_KINDS


@dataclass(frozen=True, eq=False)
class For(Stmt):
    """`for var in [min, min + extent): body`, run as `kind` says (see LOOP_KINDS).

    `annotations` holds pass hints as sorted (key, value) pairs, e.g. ('pragma_unroll', 4)."""

    var: Var
    min: Expr
    extent: Expr
    kind: str
    body: Stmt
    annotations: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "min", index_expr(self.min))
        object.__setattr__(self, "extent", index_expr(self.extent))
        if self.kind not in LOOP_KINDS:
            raise ScheduleError(f"loop {self.var.name}: unknown kind {self.kind!r}; one of {LOOP_KINDS}")
        if not self.var.dtype.is_int:
            raise DTypeError(f"loop variable {self.var.name} must be an integer, got {self.var.dtype}")
        if self.kind in THREAD_KINDS + BLOCK_KINDS and const_int(self.min) != 0:
            raise ScheduleError(f"loop {self.var.name} bound to {self.kind} must start at 0, starts at {self.min}")
        if self.kind in ("unroll", "vectorize") + THREAD_KINDS and const_int(self.extent) is None:
            raise ScheduleError(
                f"loop {self.var.name} of kind {self.kind} needs a constant extent, got {self.extent}; "
                "split it by a constant factor first"
            )

    @property
    def is_thread(self) -> bool:
        return self.kind in THREAD_KINDS

    @property
    def is_block(self) -> bool:
        return self.kind in BLOCK_KINDS

    def annotation(self, key: str, default: Any = None) -> Any:
        return dict(self.annotations).get(key, default)


@dataclass(frozen=True, eq=False)
class BufferStore(Stmt):
    """`buffer[indices] = value`. The value's dtype must be the buffer's."""

    buffer: Buffer
    indices: tuple[Expr, ...]
    value: Expr

    def __post_init__(self) -> None:
        idx = tuple(index_expr(i) for i in self.indices)
        object.__setattr__(self, "indices", idx)
        if len(idx) != self.buffer.ndim:
            raise TeccError(f"store to {self.buffer.name}: {len(idx)} indices for {self.buffer.ndim} dimensions")
        value = as_expr(self.value, self.buffer.dtype)
        if value.dtype != self.buffer.dtype:
            raise DTypeError(
                f"store to {self.buffer.name} ({self.buffer.dtype}) of a {value.dtype} value {value}; cast it first"
            )
        object.__setattr__(self, "value", value)


@dataclass(frozen=True, eq=False)
class Allocate(Stmt):
    """Allocate `buffer` (scope shared or local) for the duration of `body`.

    Shared buffers are per thread block and must have constant sizes; local buffers are per
    thread and live in registers when every index into them is a compile-time constant after
    unrolling. The contents start uninitialized."""

    buffer: Buffer
    body: Stmt

    def __post_init__(self) -> None:
        if self.buffer.scope == "global":
            raise TeccError(f"Allocate of {self.buffer.name}: global buffers are allocated by the host")
        for s in self.buffer.shape:
            if const_int(s) is None:
                raise ScheduleError(
                    f"{self.buffer.scope} buffer {self.buffer.name} needs a constant shape, got "
                    f"[{', '.join(str(x) for x in self.buffer.shape)}]"
                )


@dataclass(frozen=True, eq=False)
class IfThenElse(Stmt):
    """Run `then_case` where `cond` holds, `else_case` (if any) elsewhere; per thread."""

    cond: Expr
    then_case: Stmt
    else_case: Stmt | None = None

    def __post_init__(self) -> None:
        if not self.cond.dtype.is_bool:
            raise DTypeError(f"if condition must be bool, got {self.cond.dtype} in {self.cond}")


@dataclass(frozen=True, eq=False)
class LetStmt(Stmt):
    """Bind `var` to `value` (evaluated once) inside `body`."""

    var: Var
    value: Expr
    body: Stmt

    def __post_init__(self) -> None:
        if self.var.dtype != self.value.dtype:
            raise DTypeError(f"let {self.var.name}: variable is {self.var.dtype} but value is {self.value.dtype}")


@dataclass(frozen=True, eq=False)
class Seq(Stmt):
    """Statements run in order."""

    stmts: tuple[Stmt, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "stmts", tuple(self.stmts))


@dataclass(frozen=True, eq=False)
class Barrier(Stmt):
    """`__syncthreads()`: every thread of the block waits here until all have arrived, and
    shared-memory writes before it are visible to reads after it. Must be reached by all threads
    of the block (never inside a thread-dependent condition)."""


@dataclass(frozen=True, eq=False)
class Evaluate(Stmt):
    """Evaluate an expression for its effect (intrinsic calls)."""

    value: Expr


def seq(*stmts: Stmt | None) -> Stmt:
    """A sequence, flattening nested sequences and dropping Nones; a single statement stays itself."""
    flat: list[Stmt] = []
    for s in stmts:
        if s is None:
            continue
        if isinstance(s, Seq):
            flat.extend(s.stmts)
        else:
            flat.append(s)
    if len(flat) == 1:
        return flat[0]
    return Seq(tuple(flat))


KernelParam = Union[Buffer, Var]


@dataclass(frozen=True, eq=False)
class PrimFunc:
    """One kernel: its parameters in ABI order and its body.

    `params` are global buffers (passed as pointers) and scalar variables (sizes and strides,
    passed by value). Launch dimensions follow from the block/thread-bound loops of the body
    (`launch_dims`). `attrs` records facts passes established (e.g. the plan step that made it).
    The attr `min_blocks_per_sm` (an int) asks for that many resident blocks per SM: the
    emitter writes it as `__launch_bounds__(threads, n)`, which makes ptxas cap the registers
    per thread at 64 K / (threads · n)."""

    name: str
    params: tuple[KernelParam, ...]
    body: Stmt
    attrs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise TeccError(f"kernel name {self.name!r} must be an identifier")
        object.__setattr__(self, "params", tuple(self.params))

    def with_body(self, body: Stmt) -> "PrimFunc":
        return PrimFunc(self.name, self.params, body, self.attrs) if body is not self.body else self

    def attr(self, key: str, default: Any = None) -> Any:
        return dict(self.attrs).get(key, default)

    def __str__(self) -> str:
        return to_text(self)


@dataclass(frozen=True)
class LaunchDims:
    """Grid and block dimensions of a kernel; grid entries may depend on size variables."""

    grid: tuple[Expr, Expr, Expr]
    block: tuple[int, int, int]

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]


def iter_stmts(s: Stmt) -> Iterator[Stmt]:
    """Every statement under `s` (pre-order)."""
    stack: list[Stmt] = [s]
    while stack:
        n = stack.pop()
        yield n
        if isinstance(n, Seq):
            stack.extend(reversed(n.stmts))
        elif isinstance(n, (For, Allocate, LetStmt)):
            stack.append(n.body)
        elif isinstance(n, IfThenElse):
            if n.else_case is not None:
                stack.append(n.else_case)
            stack.append(n.then_case)


def launch_dims(func: PrimFunc) -> LaunchDims:
    """Grid and block dimensions from the block- and thread-bound loops of `func`.

    Loops bound to the same blockIdx axis must have the same extent; for a threadIdx axis the
    block takes the largest extent (smaller loops are guarded by the emitter)."""
    grid: dict[str, Expr] = {}
    block: dict[str, int] = {}
    for s in iter_stmts(func.body):
        if not isinstance(s, For):
            continue
        if s.is_block:
            prev = grid.get(s.kind)
            if prev is not None and prev is not s.extent:
                raise ScheduleError(
                    f"kernel {func.name}: loops bound to {s.kind} have different extents {prev} and {s.extent}"
                )
            grid[s.kind] = s.extent
        elif s.is_thread:
            block[s.kind] = max(block.get(s.kind, 1), const_int(s.extent) or 1)
    one = Const(1, dt.int32)
    g = tuple(grid.get(f"blockIdx.{a}", one) for a in "xyz")
    b = tuple(block.get(f"threadIdx.{a}", 1) for a in "xyz")
    return LaunchDims(g, b)  # type: ignore[arg-type]


@dataclass(frozen=True, eq=False)
class KernelCall:
    """One launch in a module's host sequence: kernel `kernel` with `args` (module-level buffers
    and variables, matched to the kernel's params in order)."""

    kernel: str
    args: tuple[KernelParam, ...]


@dataclass(frozen=True, eq=False)
class Module:
    """The kernel module (IR level 3): kernels plus the host-side sequence that runs them.

    `params` is the user-visible signature (the tensors given to `build`, in order, then the
    size variables they use); `temps` are global buffers the host allocates for intermediate
    stages; `calls` launch the kernels in order, each on the same stream."""

    name: str
    params: tuple[KernelParam, ...]
    kernels: tuple[PrimFunc, ...]
    calls: tuple[KernelCall, ...]
    temps: tuple[Buffer, ...] = ()

    def kernel(self, name: str) -> PrimFunc:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(name)

    def with_kernels(self, kernels: Sequence[PrimFunc]) -> "Module":
        return Module(self.name, self.params, tuple(kernels), self.calls, self.temps)

    def __str__(self) -> str:
        return to_text(self)
