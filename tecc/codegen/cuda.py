"""The CUDA C emitter: loop-nest IR kernels (`PrimFunc`) to one CUDA C translation unit.

Every line of a kernel comes from the IR; nothing is pasted from hand-written templates.
The mapping, statement by statement (docs/codegen.md has the full table):

  PrimFunc            extern "C" __global__ void __launch_bounds__(THREADS[, MIN_BLOCKS]) name(params)
  For serial/unroll   for (int i = min; i < min + extent; ++i)   (+ #pragma unroll)
  For vectorize       one float4/float2 access where contiguous and aligned, else #pragma unroll
  For blockIdx.x      const int bx = blockIdx.x;                  (no loop: one block per value)
  For threadIdx.x     const int tx = threadIdx.x;  + if (tx < extent) when the block is wider
  Allocate shared     __shared__ __align__(16) T name[N];
                      (over 48 KiB of shared buffers in the kernel: one `extern __shared__` array,
                      each buffer `T* const name` at its offset; `dynamic_shared_bytes`; with wgmma
                      descriptors, 1024-byte offsets from a start the kernel rounds up to 1024)
  Allocate local      T name[N];
  LetStmt             const T v = value;
  IfThenElse          if (c) { ... } else { ... }
  Barrier             __syncthreads();
  BufferStore         name[offset] = value;
  Allocate fragment   __align__(16) T name[N];                    (per-lane registers)
  MatrixMultiply, MatrixLoad, AsyncCopy: inline PTX from the intrinsic table (matrix.py)
  Instruction (fences, commit / wait groups, mbarriers, bar.sync, setmaxnreg): inline PTX from its
                      row of the instruction table (instructions.py)
  WarpgroupMatrixMultiply, BulkCopy: inline PTX for sm_90a (warpgroup.py); descriptor-addressed
                      buffers __align__(1024); TensorCopy / TensorStore: tma.py

Expressions are rendered by `cuda_expr.ExprEmitter` (precedence, half math, floor division).
Offsets are computed in `long long` for global buffers that may hold 2^31 elements or more
(`needs_64bit_indexing`), in `int` otherwise: 64-bit integer multiplies cost several
instructions on NVIDIA GPUs, so they are used only where a 32-bit offset could overflow.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

from tecc.ir import dtype as dt
from tecc.ir.dtype import DType
from tecc.ir.descriptor import DESCRIPTOR_ALIGNMENT
from tecc.ir.errors import CompileError
from tecc.ir.expr import ATOMIC_INTRINSICS, Binary, Call, Expr, Var, const_int, const_product, free_vars, walk
from tecc.ir.philox import RandomUniform
from tecc.ir.stmt import (
    Allocate,
    AsyncCopy,
    Barrier,
    Buffer,
    BufferStore,
    BulkCopy,
    Evaluate,
    For,
    IfThenElse,
    Instruction,
    LetStmt,
    MatrixLoad,
    MatrixMultiply,
    PrimFunc,
    Seq,
    Stmt,
    TensorCopy,
    TensorStore,
    WarpgroupMatrixMultiply,
    iter_stmts,
    launch_dims,
    tensor_maps,
)
from tecc.ir.index_checks import index_check_sites, site_codes
from tecc.ir.visitor import matrix_stmt_exprs

from . import instructions, matrix, philox, tma, twins, warpgroup

from .cuda_expr import FLOAT_OP_HELPER, ExprEmitter, c_type, device_helpers
from .ranges import RangeEnv
from .vectorize import emit_vector_loop

INDENT = "  "
INT32_LIMIT = 2**31

# Identifiers a kernel must not redefine: C++ keywords and the CUDA built-ins the emitter uses.
_RESERVED = frozenset("""
    alignas alignof asm auto bool break case catch char class const constexpr continue default delete do
    double else enum explicit extern false float for friend goto if inline int long mutable namespace new
    noexcept nullptr operator private protected public register restrict return short signed sizeof
    static static_cast struct switch template this throw true try typedef typename union unsigned using
    virtual void volatile while half
    threadIdx blockIdx blockDim gridDim warpSize min max abs llabs fabs fabsf fmin fminf fmax fmaxf pow
    powf exp expf log logf sqrt sqrtf rsqrt rsqrtf sin sinf cos cosf tanh tanhf erf erff exp2 exp2f log2
    log2f floor floorf ceil ceilf rint rintf isnan isinf tecc_sin_poly tecc_sin_approx tecc_cos_approx tecc_exp2_approx
    tecc_gelu_ex2 tecc_gelu_rcp tecc_gelu_erf_approx tecc_gelu_tanh_approx
    tecc_max tecc_min tecc_floordiv tecc_mod fmod fmodf copysign copysignf __float2int_rz __float2ll_rz
    __double2int_rz __double2ll_rz
""".split()) | frozenset(philox.HELPER_NAMES + ("uint2", "uint4", "make_uint2", "make_uint4", "__umulhi"))


def _c_characters(name: str) -> str:
    """`name` with every character C does not take in an identifier replaced by `_`."""
    return re.sub(r"[^0-9A-Za-z_]", "_", name)


def sanitize(name: str) -> str:
    """A C identifier for an IR name: `A.shared` -> `A_shared`; keywords get a trailing `_`."""
    text = _c_characters(name) or "v"
    if text[0].isdigit():
        text = "_" + text
    return text + "_" if text in _RESERVED else text


def written_as(name: str) -> str | None:
    """The identifier `sanitize` writes for `name` when it only replaces characters C does not
    take (`A.shared` -> `A_shared`); None when it adds one (a keyword or built-in: `max_`), since
    an identifier derived from the name (`max_acc`) then is not the written name extended."""
    text = _c_characters(name)
    return text if text and sanitize(name) == text else None


class NameTable:
    """Unique C names for the variables and buffers of one kernel.

    IR variables are identities (two `Var("i")` differ), so two distinct objects with one name
    get `i` and `i_1`; the same object always gets the same name."""

    def __init__(self) -> None:
        self._names: dict[int, str] = {}
        self._taken: set[str] = set()
        self._keepalive: list[object] = []

    def add(self, obj: object, name: str) -> str:
        if id(obj) in self._names:
            return self._names[id(obj)]
        base = sanitize(name)
        text, n = base, 0
        while text in self._taken:
            n += 1
            text = f"{base}_{n}"
        self._taken.add(text)
        self._names[id(obj)] = text
        self._keepalive.append(obj)
        return text

    def get(self, obj: object) -> str | None:
        return self._names.get(id(obj))


def needs_64bit_indexing(buffer: Buffer) -> bool:
    """Whether offsets into a global `buffer` must be computed in 64-bit arithmetic.

    True when its static element count reaches 2^31, or any dimension or stride involves an
    int64 expression (an int64 size variable says the caller may pass that many elements).
    Buffers whose dimensions are int32 size variables are assumed by the kernel ABI to hold
    fewer than 2^31 elements; the runtime's argument check is the place that enforces it."""
    if buffer.scope != "global":
        return False
    extents = buffer.shape + (buffer.strides or ())
    if any(e.dtype == dt.int64 or any(v.dtype == dt.int64 for v in free_vars(e)) for e in extents):
        return True
    count = const_product(buffer.shape)
    return count is not None and count >= INT32_LIMIT


def _stmt_exprs(s: Stmt) -> list[Expr]:
    """The expressions a statement holds directly (not those of nested statements)."""
    if isinstance(s, For):
        return [s.var, s.min, s.extent]
    if isinstance(s, BufferStore):
        return [*s.indices, s.value]
    if isinstance(s, IfThenElse):
        return [s.cond]
    if isinstance(s, LetStmt):
        return [s.var, s.value]
    if isinstance(s, Evaluate):
        return [s.value]
    return matrix_stmt_exprs(s)


def used_dtypes(func: PrimFunc) -> set[DType]:
    """Every scalar dtype a kernel touches (which decides the headers it needs)."""
    found: set[DType] = {p.dtype for p in func.params}
    for s in iter_stmts(func.body):
        if isinstance(s, (Allocate, BufferStore)):
            found.add(s.buffer.dtype)
        for e in _stmt_exprs(s):
            for node in walk(e):
                found.add(node.dtype)
                if hasattr(node, "buffer"):
                    found.add(node.buffer.dtype)
    return found


# Static `__shared__` arrays are limited to 48 KiB per block (CUDA C++ Programming Guide,
# "Shared Memory"); beyond that a kernel must use dynamic shared memory, which the runtime opts
# in to (runtime/cuda.py, _allow_dynamic_smem) up to the device's per-block opt-in limit.
STATIC_SHARED_LIMIT = 48 * 1024
DYNAMIC_SHARED = "tecc_dynamic_smem"
_SHARED_ALIGN = 128


def _count(buffer: Buffer) -> int:
    """Elements of an allocated buffer (its shape is constant)."""
    count = 1
    for extent in buffer.shape:
        count *= const_int(extent) or 0
    return count


def _shared_layout(func: PrimFunc) -> tuple[dict[int, int], int, int]:
    """The kernel's shared buffers packed into one allocation: byte offsets (by buffer id; each
    start 128-byte aligned, 1024-byte aligned in a kernel whose wgmma descriptors address shared
    buffers), the padded total, and where the last buffer ends."""
    align = DESCRIPTOR_ALIGNMENT if warpgroup.descriptor_buffers(func) else _SHARED_ALIGN
    offsets: dict[int, int] = {}
    total = end = 0
    for s in iter_stmts(func.body):
        if isinstance(s, Allocate) and s.buffer.scope == "shared" and id(s.buffer) not in offsets:
            nbytes = _count(s.buffer) * s.buffer.dtype.bytes
            offsets[id(s.buffer)] = total
            end = total + nbytes
            total += -(-nbytes // align) * align
    return offsets, total, end


def shared_offsets(func: PrimFunc) -> dict[int, int] | None:
    """Byte offsets (by buffer id) of the kernel's shared buffers in one dynamic allocation, or
    None when they fit in static shared memory (48 KiB), which is then used as before."""
    offsets, total, _ = _shared_layout(func)
    return offsets if total > STATIC_SHARED_LIMIT else None


def dynamic_shared_bytes(func: PrimFunc) -> int:
    """Bytes of dynamic shared memory a launch of `func` needs (0: its shared buffers are static).
    With wgmma descriptors, DESCRIPTOR_ALIGNMENT bytes more: the kernel rounds the allocation's
    start up to a multiple of 1024 bytes itself (C++ does not promise the extern array's alignment)."""
    _, total, end = _shared_layout(func)
    if total <= STATIC_SHARED_LIMIT:
        return 0
    return end + (DESCRIPTOR_ALIGNMENT if warpgroup.descriptor_buffers(func) else 0)


class KernelEmitter:
    """Emits one PrimFunc. Holds the C names, the 64-bit decisions, the variable ranges in
    scope and the output lines; `stmt` dispatches on the statement type."""

    def __init__(self, func: PrimFunc, check_codes: Mapping[tuple[str, str, int], int] | None = None) -> None:
        self.func = func
        self.dims = launch_dims(func)
        self.names = NameTable()
        self.ranges = RangeEnv()
        self.lines: list[str] = []
        self.depth = 0
        self.scopes: list[set[str]] = [set()]
        self.stored = {id(s.buffer) for s in iter_stmts(func.body) if isinstance(s, BufferStore)}
        # an atomic writes its element too: that buffer is no `const` parameter either
        self.stored |= {id(n.args[0].buffer) for s in iter_stmts(func.body) for e in _stmt_exprs(s)  # type: ignore[attr-defined]
                        for n in walk(e) if isinstance(n, Call) and n.name in ATOMIC_INTRINSICS}
        self.wide = {p for p in func.params if isinstance(p, Buffer) and needs_64bit_indexing(p)}
        self.dynamic_shared = shared_offsets(func)
        self.descriptor_buffers = warpgroup.descriptor_buffers(func) | tma.swizzled_destinations(func)
        self.element_counts = {id(s.buffer): _count(s.buffer) for s in iter_stmts(func.body) if isinstance(s, Allocate)}
        self.expr = ExprEmitter(self.var_name, self.buffer_name, self.wide, self.ranges)
        self.expr.check_code = lambda e: (check_codes or {}).get((func.name, e.tensor, e.dim), -1)
        for p in func.params:
            self.names.add(p, p.name)

    # ---- names ----------------------------------------------------------------------------
    def var_name(self, v: Var) -> str:
        name = self.names.get(v)
        if name is None:
            raise CompileError(
                f"kernel {self.func.name}: variable {v.name} is used but is neither a parameter nor "
                "bound by an enclosing loop or let; add it to the PrimFunc's params")
        return name

    def buffer_name(self, b: Buffer) -> str:
        name = self.names.get(b)
        if name is None:
            raise CompileError(
                f"kernel {self.func.name}: buffer {b.name} is accessed but is neither a parameter nor "
                "allocated by an enclosing Allocate")
        return name

    # ---- output ---------------------------------------------------------------------------
    def line(self, text: str) -> None:
        self.lines.append(INDENT * self.depth + text)

    def open_block(self, header: str) -> None:
        self.line(header + " {")
        self.depth += 1
        self.scopes.append(set())

    def close_block(self, trailer: str = "}") -> None:
        self.depth -= 1
        self.scopes.pop()
        self.line(trailer)

    def declare(self, name: str) -> bool:
        """Note a declaration in the current C scope; True when the name is already declared
        there (a second binding of one variable by sibling statements), so the caller must open
        a block of its own."""
        if name in self.scopes[-1]:
            return True
        self.scopes[-1].add(name)
        return False

    # ---- kernel ---------------------------------------------------------------------------
    def signature(self) -> str:
        params = []
        for p in self.func.params:
            name = self.names.get(p)
            if isinstance(p, Buffer):
                const = "" if id(p) in self.stored else "const "
                params.append(f"{const}{c_type(p.dtype)}* __restrict__ {name}")
            else:
                params.append(f"{c_type(p.dtype)} {name}")
        params += tma.tensor_map_params(self.func)
        bounds = str(self.dims.threads)
        min_blocks = self.func.attr("min_blocks_per_sm")
        if min_blocks is not None and int(min_blocks) > 1:
            bounds += f", {int(min_blocks)}"
        return f'extern "C" __global__ void __launch_bounds__({bounds}) {sanitize(self.func.name)}({", ".join(params)})'

    def emit(self) -> str:
        for p in self.func.params:
            if isinstance(p, Buffer) and p.scope != "global":
                raise CompileError(f"kernel {self.func.name}: parameter {p.name} must be a global buffer, is {p.scope}")
        self.open_block(self.signature())
        self.stmt(self.func.body)
        self.close_block()
        return "\n".join(self.lines) + "\n"

    # ---- statements -----------------------------------------------------------------------
    def stmt(self, s: Stmt) -> None:
        method = getattr(self, "_" + type(s).__name__, None)
        if method is None:
            raise CompileError(f"the CUDA emitter has no rule for the statement {type(s).__name__}")
        method(s)

    def _Seq(self, s: Seq) -> None:
        for x in s.stmts:
            self.stmt(x)

    def _BufferStore(self, s: BufferStore) -> None:
        self.line(f"{self.expr.buffer_ref(s.buffer, s.indices)} = {self.expr.code(s.value)};")

    def _Evaluate(self, s: Evaluate) -> None:
        self.line(f"{self.expr.code(s.value)};")

    def _Barrier(self, s: Barrier) -> None:
        self.line("__syncthreads();")

    # Matrix-fragment statements: inline PTX printed from the intrinsic table (matrix.py).
    def _MatrixMultiply(self, s: MatrixMultiply) -> None:
        self.lines_of(matrix.matrix_multiply(self.expr, s))

    def _MatrixLoad(self, s: MatrixLoad) -> None:
        self.lines_of(matrix.matrix_load(self.expr, s))

    def _AsyncCopy(self, s: AsyncCopy) -> None:
        self.lines_of(matrix.async_copy(self.expr, s))

    # Fences, commit and wait groups, mbarrier operations, named barriers, setmaxnreg: inline PTX
    # printed from their row of the instruction table (instructions.py).
    def _Instruction(self, s: Instruction) -> None:
        self.lines_of(instructions.instruction(self.expr, s, self.element_counts))

    # Hopper statements: wgmma, mbarriers, bulk copies (warpgroup.py).
    def _WarpgroupMatrixMultiply(self, s: WarpgroupMatrixMultiply) -> None:
        self.lines_of(warpgroup.warpgroup_multiply(self.expr, s))

    def _BulkCopy(self, s: BulkCopy) -> None:
        self.lines_of(warpgroup.bulk_copy(self.expr, s))

    def _TensorCopy(self, s: TensorCopy) -> None:
        self.lines_of(tma.tensor_copy(self.expr, s))

    def _TensorStore(self, s: TensorStore) -> None:
        self.lines_of(tma.tensor_store(self.expr, s))

    def lines_of(self, texts: list[str]) -> None:
        for text in texts:
            self.line(text)

    def _IfThenElse(self, s: IfThenElse) -> None:
        self.open_block(f"if ({self.expr.code(s.cond)})")
        self.stmt(s.then_case)
        node = s.else_case
        # An else branch that is itself an if reads as `else if`.
        while isinstance(node, IfThenElse):
            self.close_block(f"}} else if ({self.expr.code(node.cond)}) {{")
            self.depth += 1
            self.scopes.append(set())
            self.stmt(node.then_case)
            node = node.else_case
        if node is not None:
            self.close_block("} else {")
            self.depth += 1
            self.scopes.append(set())
            self.stmt(node)
        self.close_block()

    def _bind(self, var: Var, value_text: str, body: Stmt, interval: tuple[int | None, int | None],
              guard: str | None = None) -> None:
        """`const T var = value;` then `body` (inside `if (guard)` when given), with the
        variable's range known while the body is emitted."""
        name = self.names.add(var, var.name)
        nested = self.declare(name)
        if nested:
            self.open_block("")
            self.declare(name)
        self.line(f"const {c_type(var.dtype)} {name} = {value_text};")
        previous = self.ranges.bind(var, interval)
        if guard is not None:
            self.open_block(f"if ({guard})")
            self.stmt(body)
            self.close_block()
        else:
            self.stmt(body)
        self.ranges.restore(var, previous)
        if nested:
            self.close_block()

    def _LetStmt(self, s: LetStmt) -> None:
        self._bind(s.var, self.expr.code(s.value), s.body, self.ranges.interval(s.value))

    def _Allocate(self, s: Allocate) -> None:
        b = s.buffer
        name = self.names.add(b, b.name)
        count = 1
        for extent in b.shape:
            count *= const_int(extent) or 0
        nested = self.declare(name)
        if nested:
            self.open_block("")
            self.declare(name)
        if b.scope == "shared" and self.dynamic_shared is not None:
            # offsets are multiples of 128 bytes, so float4 accesses stay aligned
            self.line(f"extern __shared__ __align__(16) unsigned char {DYNAMIC_SHARED}[];")
            base = DYNAMIC_SHARED
            if self.descriptor_buffers:
                # descriptors need 1024-byte aligned tiles: round the start up (dynamic_shared_bytes
                # asked for the slack); offsets are multiples of 1024 bytes then
                mask = DESCRIPTOR_ALIGNMENT - 1
                base = (f"({DYNAMIC_SHARED} + ((0u - static_cast<unsigned>(__cvta_generic_to_shared({DYNAMIC_SHARED})))"
                        f" & {mask}u))")
            self.line(f"{c_type(b.dtype)}* const {name} = reinterpret_cast<{c_type(b.dtype)}*>"
                      f"({base} + {self.dynamic_shared[id(b)]});")
        elif b.scope == "shared":
            # 16-byte alignment lets any staged tile be read with float4 accesses; a tile that
            # wgmma descriptors address starts at a multiple of 1024 bytes (tecc.ir.descriptor).
            align = 1024 if id(b) in self.descriptor_buffers else 16
            self.line(f"__shared__ __align__({align}) {c_type(b.dtype)} {name}[{count}];")
        elif b.scope == "fragment":
            self.line(matrix.fragment_declaration(b, name, count))
        else:
            self.line(f"{c_type(b.dtype)} {name}[{count}];")
        self.stmt(s.body)
        if nested:
            self.close_block()

    def _For(self, s: For) -> None:
        if s.is_block or s.is_thread:
            self._bound_loop(s)
            return
        if s.kind == "vectorize" and emit_vector_loop(self, s):
            return
        name = self.names.add(s.var, s.var.name)
        end = loop_end(s)
        unroll = s.annotation("pragma_unroll")
        if s.kind in ("unroll", "vectorize"):
            self.line("#pragma unroll")
        elif unroll is not None:
            self.line(f"#pragma unroll {int(unroll)}")
        start = self.expr.code(s.min)
        previous = self.ranges.bind(s.var, self.ranges.loop_interval(s.min, s.extent))
        self.open_block(f"for ({c_type(s.var.dtype)} {name} = {start}; {name} < {self.expr.code(end)}; ++{name})")
        self.stmt(s.body)
        self.close_block()
        self.ranges.restore(s.var, previous)

    def _bound_loop(self, s: For) -> None:
        """A loop bound to blockIdx/threadIdx: no loop, each block/thread takes one value.
        A thread loop narrower than the block (several loops may bind one axis; the block gets
        the widest) is guarded so the extra threads skip it."""
        axis = "xyz".index(s.kind[-1])
        name = self.names.add(s.var, s.var.name)
        guard = None
        extent = const_int(s.extent)
        if s.is_thread and extent is not None and extent < self.dims.block[axis]:
            guard = f"{name} < {self.expr.code(s.extent)}"
        self._bind(s.var, s.kind, s.body, self.ranges.loop_interval(s.min, s.extent), guard)


def loop_end(loop: For) -> Expr:
    """The exclusive upper bound `min + extent`, read back as `hi` when the extent was built as
    `hi - min` (a loop from lo to hi), so the C condition reads `i < hi`."""
    if const_int(loop.min) == 0:
        return loop.extent
    extent = loop.extent
    if isinstance(extent, Binary) and extent.op == "-" and extent.b is loop.min and extent.dtype == loop.min.dtype:
        return extent.a
    return loop.min + extent


def emit_kernel(func: PrimFunc, check_codes: Mapping[tuple[str, str, int], int] | None = None) -> str:
    """The CUDA C definition of one kernel (no headers; see `emit_source`). `check_codes`: the
    numbers of its data-dependent index checks in the module's error record (index_checks.py)."""
    return KernelEmitter(func, check_codes).emit()


def needed_headers(funcs: Sequence[PrimFunc]) -> list[str]:
    """The headers a translation unit of `funcs` needs: only the half-precision ones, and
    only when a half type occurs (NVRTC provides the rest of the device built-ins)."""
    dtypes: set[DType] = set()
    for f in funcs:
        dtypes |= used_dtypes(f)
    headers = []
    if dt.float16 in dtypes:
        headers.append("cuda_fp16.h")
    if dt.bfloat16 in dtypes:
        headers.append("cuda_bf16.h")
    if dtypes & set(dt.FP8_DTYPES):
        headers.append("cuda_fp8.h")
    return headers


def used_intrinsics(funcs: Sequence[PrimFunc]) -> set[str]:
    """The names of every Call in the kernels, the helpers of float operators
    (`FLOAT_OP_HELPER`) and philox.RAND_HELPER where tc.rand is, which decide the device
    helpers they need."""
    names: set[str] = set()
    for f in funcs:
        for s in iter_stmts(f.body):
            for e in _stmt_exprs(s):
                for node in walk(e):
                    if isinstance(node, Call):
                        names.add(node.name)
                    elif isinstance(node, Binary) and node.op in FLOAT_OP_HELPER and node.dtype.is_float:
                        names.add(FLOAT_OP_HELPER[node.op])
                    elif isinstance(node, RandomUniform):
                        names.add(philox.RAND_HELPER)
    return names


def emit_source(funcs: Sequence[PrimFunc]) -> str:
    """One CUDA C translation unit holding every kernel of `funcs`: headers, then the device
    helpers the kernels call (each once; `cuda_expr.device_helpers`), then the kernels."""
    prelude, kernels = emit_parts(funcs)
    return prelude + "".join("\n" + k for k in kernels)


def emit_parts(funcs: Sequence[PrimFunc]) -> tuple[str, list[str]]:
    """`emit_source` in its parts: the prelude (headers and device helpers) and each kernel's
    text, in the order of `funcs`."""
    names = [f.name for f in funcs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise CompileError(f"two kernels share the name {duplicates[0]}; kernel names must be unique")
    parts = ["// Generated by tecc.codegen from the loop-nest IR. Do not edit: change the IR or the emitter."]
    if any(warpgroup.needs_arch_specific(f) for f in funcs):
        parts.append(warpgroup.ARCH_SPECIFIC_MARK)  # compile_cuda compiles it for sm_XYa
    parts += [f"#include <{h}>" for h in needed_headers(funcs)]
    if any(tensor_maps(f) for f in funcs):
        parts.append(tma.TENSOR_MAP_DECLARATION)
    text = "\n".join(parts) + "\n"
    helpers = device_helpers(used_intrinsics(funcs))
    if helpers:
        text += "\n" + "".join(helpers)
    codes = site_codes(index_check_sites(funcs))
    checked = {kernel for kernel, _, _ in codes}   # their error codes differ kernel to kernel
    # the kernels of one structure (a model's layers) written from one text (twins.py)
    templates = twins.Templates(lambda f: emit_kernel(f, codes), written_as, frozenset(twins.identifiers(text)))
    texts = []
    for f in funcs:
        written = templates.text(f) if f.name not in checked else None
        texts.append(written if written is not None else emit_kernel(f, codes))
    return text, texts

