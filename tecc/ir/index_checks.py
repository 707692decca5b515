"""The run-time checks of data-dependent indices: the `IndexCheck` node, the sites of a module's
checks and the error record they fill.

Lowering guards every access whose index reads a tensor (`W[idx[i], j]`, a scatter's
`dW[idx[i], j]`) with an `IndexCheck` (below). On the GPU a failing check records the
first bad index of a launch sequence in one `__device__` array of the module, the *error record*,
and the runtime reads it back when the call's results are synchronized (docs/runtime.md,
"Data-dependent indices"). The code generator and the runtime must agree on two things, both
fixed here:

- the **sites**: every distinct (kernel, tensor, dimension) checked, numbered in the order of
  the kernels and, inside a kernel, of first occurrence in its statements (`index_check_sites`);
  the record stores a site's number, the manifest stores the sites;
- the **record**: `RECORD_SYMBOL`, RECORD_WORDS signed 64-bit words: site number + 1 (0: no
  error), the bad value, the extent it had to be below, the linear block and the linear thread
  that found it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from . import dtype as dt
from .errors import DTypeError
from .expr import Call, Expr, walk

RECORD_SYMBOL = "tecc_index_error"
RECORD_WORDS = 5


class IndexCheck(Call):
    """`index_ok(value, extent)`: whether the data-dependent index `value` (one read from a
    tensor, `W[idx[i], j]`) lies in [0, extent), dimension `dim` of tensor `tensor`; bool.

    An index outside is an error of the program, never wrapped (a negative index is out of range:
    torch's wrap of negative indices is the caller's to write). The emulator raises
    OutOfBoundsError naming the tensor, the dimension and the value; generated CUDA records the
    first such index in the module's error record (docs/runtime.md, "Data-dependent indices"),
    which the runtime raises as OutOfBoundsError when the call's results are synchronized, and the
    check evaluates false. Lowering guards every data-dependent access with it, so the access is
    skipped (a read gives 0, a scatter adds nothing) and no memory outside the tensor is touched."""

    __slots__ = ("value", "extent", "tensor", "dim")
    _fields = ("value", "extent", "tensor", "dim")
    value: Expr
    extent: Expr
    tensor: str
    dim: int

    def _init(self, value: Expr, extent: Expr, tensor: str, dim: int) -> None:  # type: ignore[override]
        if not value.dtype.is_int or not extent.dtype.is_int:
            raise DTypeError(f"index_ok needs an integer index and extent, got {value.dtype} {value} and "
                             f"{extent.dtype} {extent}")
        Call._init(self, "index_ok", (value, extent), dt.bool_)
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "extent", extent)
        object.__setattr__(self, "tensor", str(tensor))
        object.__setattr__(self, "dim", int(dim))

    def with_args(self, args: tuple[Expr, ...]) -> "Call":
        return IndexCheck(args[0], args[1], self.tensor, self.dim)


@dataclass(frozen=True)
class CheckSite:
    """One checked dimension of one tensor in one kernel."""

    kernel: str
    tensor: str
    dim: int

    def to_json(self) -> list[Any]:
        return [self.kernel, self.tensor, self.dim]

    @staticmethod
    def from_json(j: Sequence[Any]) -> "CheckSite":
        return CheckSite(str(j[0]), str(j[1]), int(j[2]))


def index_check_sites(kernels: Sequence[Any]) -> tuple[CheckSite, ...]:
    """The sites of the IndexChecks in `kernels` (PrimFuncs), numbered as the record stores them."""
    from .stmt import BufferStore, Evaluate, For, IfThenElse, LetStmt, iter_stmts
    from .visitor import matrix_stmt_exprs

    def held(s: Any) -> list[Any]:
        if isinstance(s, For):
            return [s.min, s.extent]
        if isinstance(s, BufferStore):
            return [*s.indices, s.value]
        if isinstance(s, IfThenElse):
            return [s.cond]
        if isinstance(s, (LetStmt, Evaluate)):
            return [s.value]
        return matrix_stmt_exprs(s)

    out: list[CheckSite] = []
    for k in kernels:
        for s in iter_stmts(k.body):
            for e in held(s):
                for n in walk(e):
                    if isinstance(n, IndexCheck):
                        site = CheckSite(k.name, n.tensor, n.dim)
                        if site not in out:
                            out.append(site)
    return tuple(out)


def describe_failure(module: str, sites: Sequence[CheckSite], record: Sequence[int]) -> str:
    """The OutOfBoundsError message of a filled record."""
    code, value, extent, block, thread = (int(x) for x in record[:RECORD_WORDS])
    if 1 <= code <= len(sites):
        site = sites[code - 1]
        where = f"dimension {site.dim} of {site.tensor} (size {extent}) in kernel {site.kernel}"
    else:
        where = f"a tensor (check {code - 1}, size {extent})"
    return (f"{module}: a data-dependent index is out of range: {value} indexes {where}, found by block {block}, "
            f"thread {thread} (the first such index of the call; tecc does not wrap negative indices). The "
            "accesses it guarded were skipped, so the outputs are not valid; fix the indices")


def site_codes(sites: Sequence[CheckSite]) -> Mapping[tuple[str, str, int], int]:
    """(kernel, tensor, dim) -> the site number the generated code records."""
    return {(s.kernel, s.tensor, s.dim): n for n, s in enumerate(sites)}


__all__ = ["CheckSite", "IndexCheck", "RECORD_SYMBOL", "RECORD_WORDS", "describe_failure", "index_check_sites", "site_codes"]
