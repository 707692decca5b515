"""Outputs allocated for the caller: `C = f(A, B)` when the outputs are left out.

A module's outputs are the buffer parameters its kernels write (`HostProgram.outputs`). A call
that passes only the other parameters (the inputs, in signature order) gets the outputs made
for it, then runs exactly as the in-place call `f(A, B, C)` would:

- **sizes** from the size variables the inputs' dimensions bind (`M` of `A: (M, K)`); an output
  dimension no input determines is a ShapeError that says to pass the output;
- **like the inputs**: like the first input, by its kind. A torch tensor gives torch tensors on
  the same device (`new_empty`, so they come from torch's caching allocator, stream-ordered on
  torch's current stream); a NumPy array gives NumPy arrays; another array library that has an
  `empty(shape, dtype=...)` function at its top level (CuPy) gives its arrays. The emulator
  (`f.sim`) always gives NumPy arrays.

Nothing here imports torch: the tensor's own package is found through its type.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import numpy as np

from ..ir.dtype import DType
from ..ir.errors import ShapeError, TeccError
from ..ir.evaluate import evaluate_int
from ..ir.expr import Var, free_vars
from ..ir.stmt import Buffer
from .host import HostProgram


# Distinct tuples of input shapes whose output shapes an allocator remembers.
SHAPE_CACHE_SIZE = 256


class OutputAllocator:
    """Makes the outputs of `host` for a call that passes only its inputs.

    `inputs` are the buffer parameters that are not outputs, in signature order, and
    `arity` their number; `complete(args, like_numpy)` returns the full argument list (inputs and
    new outputs in signature order) and the new outputs."""

    def __init__(self, host: HostProgram) -> None:
        self.host = host
        written = set(host.outputs)
        params = host.buffer_params
        self.inputs = tuple(b for b in params if b.name not in written)
        self.outputs = tuple(b for b in params if b.name in written)
        self.arity = len(self.inputs)
        self._positions = tuple(b.name in written for b in params)
        self.positions = self._positions  # per buffer parameter: whether it is an output
        self._shapes: dict[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]] = {}
        self._producer_dtypes: dict[type, Any] = {}  # array type -> its package's output dtypes, or None

    def accepts(self, count: int) -> bool:
        """Whether a call with `count` arrays leaves exactly the outputs out (and there are some)."""
        return count == self.arity and bool(self.outputs) and count != len(self._positions)

    def shapes(self, args: Sequence[Any]) -> tuple[tuple[int, ...], ...]:
        """The outputs' shapes for inputs `args` (cached per tuple of input shapes: a NumPy
        shape and a torch.Size are tuples, so the key costs one attribute read per input)."""
        try:
            key = tuple([a.shape for a in args])
            found = self._shapes.get(key)
        except (AttributeError, TypeError):  # no shape, or an unhashable one
            key, found = None, None
        if found is None:
            given = tuple(_shape(a, b, self.host.name) for a, b in zip(args, self.inputs))
            found = self._derive(given)
            if key is not None and len(self._shapes) < SHAPE_CACHE_SIZE:
                self._shapes[key] = found
        return found

    def _derive(self, input_shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        env: dict[Var, int] = {}
        for buf, shape in zip(self.inputs, input_shapes):
            if len(shape) != buf.ndim:
                raise ShapeError(
                    f"{self.host.name}: input {buf.name} has {buf.ndim} dimensions "
                    f"[{', '.join(str(s) for s in buf.shape)}], got shape {shape}"
                )
            for dim, n in zip(buf.shape, shape):
                if isinstance(dim, Var) and dim not in env:
                    env[dim] = n
        out = []
        for buf in self.outputs:
            for pos, dim in enumerate(buf.shape):
                missing = [v.name for v in free_vars(dim) if v not in env]
                if missing:
                    raise ShapeError(
                        f"{self.host.name}: cannot allocate output {buf.name}: dimension {pos} ({dim}) needs "
                        f"{', '.join(sorted(missing))}, which no input's shape determines; pass {buf.name} yourself "
                        f"(f({', '.join(b.name for b in self.host.buffer_params)}))"
                    )
            out.append(tuple(evaluate_int(dim, env) for dim in buf.shape))
        return tuple(out)

    def complete(self, args: Sequence[Any], numpy_only: bool = False) -> tuple[list[Any], list[Any]]:
        """The full argument list for `args` (the inputs) and the outputs made for it."""
        shapes = self.shapes(args)
        first = args[0] if args else None
        if numpy_only or first is None or type(first) is np.ndarray:
            outputs = [np.empty(shape, buf.dtype.numpy) for shape, buf in zip(shapes, self.outputs)]
        else:
            kind = type(first)
            dtypes = self._producer_dtypes.get(kind, _UNSEEN)
            if dtypes is _UNSEEN:
                dtypes = self._producer_dtypes[kind] = producer_dtypes(first, [b.dtype for b in self.outputs])
            if dtypes is not None:  # torch-like: new_empty on the first input's device
                outputs = [first.new_empty(shape, dtype=d) for shape, d in zip(shapes, dtypes)]  # type: ignore[union-attr]
            else:
                make = allocator_like(first, self.host.name)
                outputs = [make(shape, buf.dtype) for shape, buf in zip(shapes, self.outputs)]
        return list(self.interleave(args, outputs)), outputs

    def interleave(self, inputs: Sequence[Any], outputs: Sequence[Any]) -> tuple[Any, ...]:
        """The whole argument list: `inputs` and `outputs`, each in its signature position."""
        given, made = iter(inputs), iter(outputs)
        return tuple(next(made) if is_output else next(given) for is_output in self._positions)


def returned(outputs: list[Any]) -> Any:
    """What a call that allocated its outputs returns: one output bare, several as a tuple."""
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _shape(arg: Any, buf: Buffer, module: str) -> tuple[int, ...]:
    shape = getattr(arg, "shape", None)
    if shape is None:
        raise TeccError(f"{module}: input {buf.name} is a {type(arg).__name__}, which has no shape; pass an array")
    return tuple(int(n) for n in shape)


_UNSEEN = object()


def producer_dtypes(array: Any, dtypes: Sequence[DType]) -> tuple[Any, ...] | None:
    """The dtype objects of a torch-like `array`'s package for `dtypes` (torch.float32, ...), or
    None when `array` has no `new_empty` or its package lacks one of them."""
    package = sys.modules.get(type(array).__module__.partition(".")[0])
    if package is None or not callable(getattr(array, "new_empty", None)):
        return None
    found = tuple(getattr(package, d.name, None) for d in dtypes)
    return None if any(f is None for f in found) else found


def _numpy_empty(shape: tuple[int, ...], dtype: DType) -> Any:
    return np.empty(shape, dtype.numpy)


def allocator_like(array: Any, module: str = "") -> Callable[[tuple[int, ...], DType], Any]:
    """A function (shape, dtype) -> a new uninitialized array of the same kind as `array`, on
    its device (see the module docstring)."""
    if isinstance(array, np.ndarray):
        return _numpy_empty
    package = sys.modules.get(type(array).__module__.partition(".")[0])
    new_empty = getattr(array, "new_empty", None)
    if callable(new_empty) and package is not None:
        def torch_like(shape: tuple[int, ...], dtype: DType) -> Any:
            producer_dtype = getattr(package, dtype.name, None)
            if producer_dtype is None:
                raise TeccError(f"{module}: {package.__name__} has no dtype {dtype.name} for an output")
            # on the array's device; torch: from its caching allocator, ordered on the current stream
            return new_empty(shape, dtype=producer_dtype)

        return torch_like
    empty = getattr(package, "empty", None)
    if callable(empty):
        return lambda shape, dtype: empty(shape, dtype=dtype.numpy)
    raise TeccError(
        f"{module}: cannot allocate outputs like a {type(array).__name__} (no new_empty method, no "
        f"empty function in its package); pass the outputs yourself"
    )
