"""The instruction rows of the intrinsic table: statements that are one PTX instruction with a
few operands (fences, commit and wait groups, mbarrier operations, named barriers, setmaxnreg).

Part of tecc.ir.stmt (which re-exports every name here). Like the matrix rows of
tecc.ir.intrinsics, each instruction is declared once, as data (`InstructionRow`): its operands,
how it prints in the IR, the inline PTX codegen prints from it (tecc.codegen.cuda), and its name,
under which the emulator keeps its semantics (tecc.runtime.sim.instructions). An `Instruction`
statement names a row and holds the operands; a new instruction is a new row, not a new node
class with its own printer, visitor, mutator, emitter and emulator rule.

The IR's earlier classes live on as constructors of their row's statements (`WarpgroupWait(1)`,
`BarrierWait(bar, parity)`), and `isinstance(s, WarpgroupWait)` still asks whether `s` is one; a
visitor's `visit_WarpgroupWait` is called for them before `visit_Instruction`.

What each instruction means (who executes it, what it orders) is written next to its row.

Operand kinds:
  'expr'     an integer index expression, passed to the asm as a 32-bit register ("r", unsigned);
  'barrier'  an mbarrier (BarrierRef), passed as its 32-bit shared-window address ("r");
  'imm'      a Python int, printed into the instruction text;
  'flag'     a bool, printed as one of two spellings (setmaxnreg's dec / inc);
  'pinned'   fragment buffers whose registers codegen pins after the instruction (an empty asm
             with each register as a "+f" operand), so the C compiler keeps their reads after it;
  'tensormap' a TMA tensor map (TensorMap), passed as the 64-bit generic address of its kernel
             parameter ("l").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .errors import DTypeError, ScheduleError
from .expr import Expr, as_expr, const_int, index_expr
from .intrinsics import IntrinsicError
from .mbarrier_stmt import MAX_ARRIVALS, MAX_TX_BYTES, BarrierRef
from .stmt_nodes import Buffer, Stmt
from .tma_stmt import TensorMap

OPERAND_KINDS = ("expr", "barrier", "imm", "flag", "pinned", "tensormap")
MAX_GROUPS = 8         # the wait_group operands: PTX accepts 0..7 pending groups
NAMED_BARRIERS = 16    # bar.sync ids 0..15; id 0 is __syncthreads'
_REQUIRED = object()


@dataclass(frozen=True)
class InstructionOperand:
    """One operand of an instruction row: its name (the statement's attribute), its kind (the
    module docstring), its default (none: required) and, for a flag, its two spellings."""

    name: str
    kind: str
    default: Any = _REQUIRED
    spellings: tuple[str, str] = ("", "")

    def __post_init__(self) -> None:
        if self.kind not in OPERAND_KINDS:
            raise IntrinsicError(f"operand {self.name}: kind {self.kind!r} is not one of {OPERAND_KINDS}")


Checker = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class InstructionRow:
    """One instruction: `name` (its PTX mnemonic, the key of the table), `constructor` (the IR's
    name for its statements), `operands`, `text` (how it prints: a format string over the
    operands), `ptx` (the inline-asm lines codegen prints: `{name}` for an imm or flag, `%k` for
    the k-th expr or barrier operand), `one_line` (printed as a one-line asm statement: no
    register operands), `arch_specific` (needs the sm_90a target), `check` (validates and
    normalizes the operands, raising a TeccError that names the instruction)."""

    name: str
    constructor: str
    operands: tuple[InstructionOperand, ...]
    text: str
    ptx: tuple[str, ...]
    one_line: bool = False
    arch_specific: bool = False
    check: Checker | None = None

    def operand(self, name: str) -> InstructionOperand:
        for o in self.operands:
            if o.name == name:
                return o
        raise IntrinsicError(f"{self.name} has no operand {name!r}; it has {', '.join(o.name for o in self.operands)}")


@dataclass(frozen=True, eq=False)
class Instruction(Stmt):
    """The instruction of row `name` of the table (`ROWS`) on `operands`, in the row's operand
    order; the row says what it means. Operands read as attributes (`s.pending`, `s.bar`)."""

    name: str
    operands: tuple[Any, ...]

    def __post_init__(self) -> None:
        row = instruction_row(self.name)
        values = tuple(self.operands)
        if len(values) != len(row.operands):
            raise IntrinsicError(f"{row.name} takes {len(row.operands)} operand(s) "
                                 f"({', '.join(o.name for o in row.operands)}), got {len(values)}")
        named = {o.name: v for o, v in zip(row.operands, values)}
        for o in row.operands:
            if o.kind == "expr":
                named[o.name] = as_expr(named[o.name])
            elif o.kind == "pinned":
                named[o.name] = tuple(named[o.name])
        if row.check is not None:
            named = row.check(named)
        object.__setattr__(self, "operands", tuple(named[o.name] for o in row.operands))

    @property
    def row(self) -> InstructionRow:
        return instruction_row(self.name)

    @property
    def dispatch_name(self) -> str:
        """The name a visitor's `visit_<name>` answers to before `visit_Instruction`."""
        return self.row.constructor

    def __getattr__(self, name: str) -> Any:
        fields = self.__dict__
        if "name" in fields and "operands" in fields:
            row = instruction_row(fields["name"])
            for o, v in zip(row.operands, fields["operands"]):
                if o.name == name:
                    return v
        raise AttributeError(f"{type(self).__name__} {fields.get('name', '?')} has no attribute {name!r}")

    def with_operands(self, operands: tuple[Any, ...]) -> Instruction:
        """The same instruction on other operands, or this very statement when they are the same."""
        if all(a is b for a, b in zip(operands, self.operands)):
            return self
        return Instruction(self.name, operands)

    def exprs(self) -> list[Expr]:
        """The index expressions it holds (expr operands and barrier indices), in operand order."""
        out: list[Expr] = []
        for o, v in zip(self.row.operands, self.operands):
            if o.kind == "expr":
                out.append(v)
            elif o.kind == "barrier":
                out.append(v.index)
        return out

    def buffers(self) -> tuple[Buffer, ...]:
        """The buffers it names (barriers' and pinned ones)."""
        out: list[Buffer] = []
        for o, v in zip(self.row.operands, self.operands):
            if o.kind == "barrier":
                out.append(v.buffer)
            elif o.kind == "pinned":
                out.extend(v)
        return tuple(out)


class InstructionKind:
    """The constructor of one row's statements, under the name the IR gave them as a class:
    `WarpgroupWait(1)` is `Instruction("wgmma.wait_group", (1, ()))`, positional arguments in the
    row's operand order, keywords by operand name, defaults as the row declares them; and
    `isinstance(s, WarpgroupWait)` asks whether `s` is an instruction of that row (Python's
    isinstance consults `__instancecheck__`)."""

    def __init__(self, row: InstructionRow) -> None:
        self.row = row
        self.__name__ = self.__qualname__ = row.constructor
        self.__doc__ = row.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Instruction:
        row = self.row
        if len(args) > len(row.operands):
            raise IntrinsicError(f"{row.constructor} ({row.name}) takes at most {len(row.operands)} operands, "
                                 f"got {len(args)}")
        values = dict(zip((o.name for o in row.operands), args))
        for key, value in kwargs.items():
            if key in values or all(o.name != key for o in row.operands):
                raise IntrinsicError(f"{row.constructor} ({row.name}): unexpected or repeated operand {key!r}")
            values[key] = value
        for o in row.operands:
            if o.name not in values:
                if o.default is _REQUIRED:
                    raise IntrinsicError(f"{row.constructor} ({row.name}) needs its operand {o.name!r}")
                values[o.name] = o.default
        return Instruction(row.name, tuple(values[o.name] for o in row.operands))

    def __instancecheck__(self, obj: object) -> bool:
        return isinstance(obj, Instruction) and obj.name == self.row.name

    def __repr__(self) -> str:
        return f"<instruction constructor {self.row.constructor} ({self.row.name})>"


# ---- operand checks (the messages name the instruction and say what is allowed) -------------------

def _groups(refusal: str) -> Checker:
    """A check of a `pending` group count, 0 .. MAX_GROUPS - 1; `refusal` formats the message."""
    def check(ops: dict[str, Any]) -> dict[str, Any]:
        n = ops["pending"]
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < MAX_GROUPS:
            raise IntrinsicError(refusal.format(n=n))
        return ops
    return check


def _wgmma_wait(ops: dict[str, Any]) -> dict[str, Any]:
    _groups("wgmma.wait_group takes a constant 0..7, got {n!r}")(ops)
    for b in ops["accumulators"]:
        if b.scope != "fragment":
            raise IntrinsicError(f"wgmma.wait_group: accumulator {b.name} must be a fragment buffer, is {b.scope}")
    return ops


def _setmaxnreg(ops: dict[str, Any]) -> dict[str, Any]:
    c = ops["count"]
    if isinstance(c, bool) or not isinstance(c, int) or c % 8 or not 24 <= c <= 256:
        raise IntrinsicError(f"setmaxnreg takes a multiple of 8 in [24, 256], got {c!r}")
    ops["increase"] = bool(ops["increase"])
    return ops


def _count(value: Expr, limit: int, what: str) -> Expr:
    if not value.dtype.is_int:
        raise DTypeError(f"{what} must be an integer, got {value.dtype}")
    c = const_int(value)
    if c is not None and not 0 < c <= limit:
        raise IntrinsicError(f"{what} must lie in [1, {limit}], got {c}")
    return value


def _barrier(ops: dict[str, Any], what: str) -> BarrierRef:
    bar = ops["bar"]
    if not isinstance(bar, BarrierRef):
        raise IntrinsicError(f"{what}: the barrier must be a BarrierRef (a slot of an int64 shared buffer), "
                             f"got {bar!r}")
    return bar


def _mbarrier_init(ops: dict[str, Any]) -> dict[str, Any]:
    bar = _barrier(ops, "mbarrier.init")
    ops["count"] = _count(ops["count"], MAX_ARRIVALS, f"mbarrier.init {bar} count")
    return ops


def _mbarrier_arrive(ops: dict[str, Any]) -> dict[str, Any]:
    _barrier(ops, "mbarrier.arrive")
    return ops


def _mbarrier_expect_tx(ops: dict[str, Any]) -> dict[str, Any]:
    bar = _barrier(ops, "mbarrier.arrive.expect_tx")
    ops["bytes"] = _count(ops["bytes"], MAX_TX_BYTES, f"mbarrier.expect_tx {bar} bytes")
    return ops


def _mbarrier_wait(ops: dict[str, Any]) -> dict[str, Any]:
    bar = _barrier(ops, "mbarrier wait")
    p = ops["parity"]
    if not p.dtype.is_int:
        raise DTypeError(f"mbarrier wait on {bar}: the parity must be an integer 0 or 1, got {p.dtype}")
    c = const_int(p)
    if c is not None and c not in (0, 1):
        raise IntrinsicError(f"mbarrier wait on {bar}: the parity must be 0 or 1, got {c}")
    return ops


def _tensor_map(ops: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(ops["map"], TensorMap):
        raise IntrinsicError(f"prefetch.tensormap: the operand must be a TensorMap, got {type(ops['map']).__name__}")
    return ops


def _named_barrier(ops: dict[str, Any]) -> dict[str, Any]:
    bid = index_expr(ops["id"])
    value = const_int(bid)
    if value is not None and not 1 <= value < NAMED_BARRIERS:
        raise ScheduleError(f"bar.sync: the barrier id must be 1..{NAMED_BARRIERS - 1} (0 is __syncthreads'), "
                            f"got {value}")
    threads = ops["threads"]
    if isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0 or threads % 32:
        raise ScheduleError(f"bar.sync {bid}: the thread count must be a positive multiple of 32, got {threads!r}")
    ops["id"] = bid
    return ops


# ---- the rows -------------------------------------------------------------------------------------

_OP = InstructionOperand

ROWS: tuple[InstructionRow, ...] = (
    # cp.async groups (sm_80; per thread). The thread's cp.async copies since its last commit
    # become one group; wait_group n blocks the thread until at most its n most recent groups are
    # in flight (tecc.ir.matrix_stmt says when the data may be read).
    InstructionRow("cp.async.commit_group", "AsyncCommit", (), "cp.async.commit_group()",
                   ("cp.async.commit_group;",), one_line=True),
    InstructionRow("cp.async.wait_group", "AsyncWait", (_OP("pending", "imm", 0),), "cp.async.wait_group({pending})",
                   ("cp.async.wait_group {pending};",), one_line=True,
                   check=_groups("cp.async.wait_group takes a constant 0..7, got {n!r}")),
    # wgmma's fences and groups (sm_90a; warpgroup-collective: all 128 threads of a warpgroup
    # together, tecc.ir.warpgroup_stmt). fence: orders the warpgroup's earlier register and
    # shared-memory accesses before the wgmmas that follow (needed before the first wgmma and after
    # other writes of an accumulator); commit_group: the wgmmas issued since the last commit become
    # one group; wait_group n: at most the n most recent groups stay in flight, the accumulators
    # of the others may be read; `accumulators` are pinned after the wait.
    InstructionRow("wgmma.fence", "WarpgroupFence", (), "wgmma.fence()", ("wgmma.fence.sync.aligned;",),
                   one_line=True, arch_specific=True),
    InstructionRow("wgmma.commit_group", "WarpgroupCommit", (), "wgmma.commit_group()",
                   ("wgmma.commit_group.sync.aligned;",), one_line=True, arch_specific=True),
    InstructionRow("wgmma.wait_group", "WarpgroupWait", (_OP("pending", "imm", 0), _OP("accumulators", "pinned", ())),
                   "wgmma.wait_group({pending}{accumulators})", ("wgmma.wait_group.sync.aligned {pending};",),
                   one_line=True, arch_specific=True, check=_wgmma_wait),
    # fence.proxy.async.shared::cta (sm_90, per thread): the thread's earlier ordinary
    # shared-memory accesses are ordered with later accesses by the async proxy (wgmma operand
    # reads, bulk copies, TMA stores). Ordinary stores that the async proxy reads need a barrier
    # and this fence between them.
    InstructionRow("fence.proxy.async", "AsyncProxyFence", (), "fence.proxy.async()",
                   ("fence.proxy.async.shared::cta;",), one_line=True),
    # setmaxnreg.{inc,dec}.sync.aligned.u32 count (sm_90a, warpgroup-collective): the warpgroup's
    # threads ask for (`increase`) or release registers until each has at most / at least `count`
    # (a multiple of 8 in [24, 256]); the block's register budget moves between warpgroups, as a
    # producer warpgroup that only issues copies gives registers to the consumers that hold
    # accumulators. Means something only in a kernel compiled with a register limit
    # (`min_blocks_per_sm` / launch bounds).
    InstructionRow("setmaxnreg", "SetMaxRegisters",
                   (_OP("count", "imm"), _OP("increase", "flag", spellings=("dec", "inc"))),
                   "setmaxnreg.{increase}({count})", ("setmaxnreg.{increase}.sync.aligned.u32 {count};",),
                   one_line=True, arch_specific=True, check=_setmaxnreg),
    # mbarriers (sm_90, per thread; tecc.ir.mbarrier_stmt has the phases). init: phase 0, `count`
    # arrivals expected per phase, no transactions pending (one thread; the others after a
    # __syncthreads()). arrive: one arrival on the current phase. arrive.expect_tx: the phase also
    # waits for `bytes` more bytes of asynchronous copies, then the thread arrives. wait (a
    # try_wait.parity loop in its own scope, so every wait may use the same PTX label): returns
    # once the phase of parity `parity` has completed.
    InstructionRow("mbarrier.init", "BarrierInit", (_OP("bar", "barrier"), _OP("count", "expr")),
                   "mbarrier.init({bar}, count={count})", ("mbarrier.init.shared::cta.b64 [%0], %1;",),
                   check=_mbarrier_init),
    InstructionRow("mbarrier.arrive", "BarrierArrive", (_OP("bar", "barrier"),), "mbarrier.arrive({bar})",
                   ("mbarrier.arrive.shared::cta.b64 _, [%0];",), check=_mbarrier_arrive),
    InstructionRow("mbarrier.arrive.expect_tx", "BarrierExpectTx", (_OP("bar", "barrier"), _OP("bytes", "expr")),
                   "mbarrier.arrive_expect_tx({bar}, bytes={bytes})",
                   ("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;",), check=_mbarrier_expect_tx),
    InstructionRow("mbarrier.try_wait.parity", "BarrierWait", (_OP("bar", "barrier"), _OP("parity", "expr")),
                   "mbarrier.wait({bar}, parity={parity})",
                   ("{{", ".reg .pred done;", "TECC_WAIT:", "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;",
                    "@!done bra TECC_WAIT;", "}}"), check=_mbarrier_wait),
    # bulk groups of TMA stores (sm_90, per thread; tecc.ir.tma_stmt). commit_group closes the
    # thread's open group of tensor stores; wait_group.read n waits until at most n of its
    # committed groups still read shared memory (their sources may then be overwritten).
    InstructionRow("cp.async.bulk.commit_group", "BulkCommit", (), "cp.async.bulk.commit_group()",
                   ("cp.async.bulk.commit_group;",)),
    InstructionRow("cp.async.bulk.wait_group.read", "BulkWait", (_OP("pending", "imm"),),
                   "cp.async.bulk.wait_group.read({pending})", ("cp.async.bulk.wait_group.read {pending};",),
                   check=_groups("cp.async.bulk.wait_group.read: pending must be an integer in [0, 8), got {n!r}")),
    # bar.sync id, threads: the calling threads wait until `threads` threads (a multiple of the
    # warp size) have arrived at barrier `id` (an int32 expression, uniform per warp, 1..15; 0 is
    # __syncthreads'), and their shared-memory writes before it are visible to the others' reads
    # after it. A subset of the block synchronizes (e.g. the consumer warpgroups of a
    # warp-specialized kernel, without the producer); every warp of that subset must reach it,
    # all its threads together.
    InstructionRow("bar.sync", "NamedBarrier", (_OP("id", "expr"), _OP("threads", "imm")),
                   "bar.sync({id}, threads={threads})", ("bar.sync %0, {threads};",), check=_named_barrier),
    # prefetch.tensormap (sm_90, per thread): brings a TMA tensor map (its kernel parameter, by
    # generic address) into the cache the TMA unit reads descriptors from, so the kernel's first
    # copy or store through it does not wait for the fetch. A hint: no effect on any value.
    InstructionRow("prefetch.tensormap", "TensorMapPrefetch", (_OP("map", "tensormap"),),
                   "prefetch.tensormap({map})", ("prefetch.tensormap [%0];",), check=_tensor_map),
)

TABLE: dict[str, InstructionRow] = {row.name: row for row in ROWS}


def instruction_row(name: str) -> InstructionRow:
    """The row called `name`, or IntrinsicError listing the rows."""
    row = TABLE.get(name)
    if row is None:
        raise IntrinsicError(f"no instruction {name!r}; the table has {', '.join(TABLE)}")
    return row


def _kind(name: str) -> InstructionKind:
    return InstructionKind(TABLE[name])


AsyncCommit = _kind("cp.async.commit_group")
AsyncWait = _kind("cp.async.wait_group")
WarpgroupFence = _kind("wgmma.fence")
WarpgroupCommit = _kind("wgmma.commit_group")
WarpgroupWait = _kind("wgmma.wait_group")
AsyncProxyFence = _kind("fence.proxy.async")
SetMaxRegisters = _kind("setmaxnreg")
BarrierInit = _kind("mbarrier.init")
BarrierArrive = _kind("mbarrier.arrive")
BarrierExpectTx = _kind("mbarrier.arrive.expect_tx")
BarrierWait = _kind("mbarrier.try_wait.parity")
BulkCommit = _kind("cp.async.bulk.commit_group")
BulkWait = _kind("cp.async.bulk.wait_group.read")
NamedBarrier = _kind("bar.sync")
TensorMapPrefetch = _kind("prefetch.tensormap")

CONSTRUCTORS: dict[str, InstructionKind] = {k.row.constructor: k for k in (
    AsyncCommit, AsyncWait, WarpgroupFence, WarpgroupCommit, WarpgroupWait, AsyncProxyFence, SetMaxRegisters,
    BarrierInit, BarrierArrive, BarrierExpectTx, BarrierWait, BulkCommit, BulkWait, NamedBarrier, TensorMapPrefetch)}
