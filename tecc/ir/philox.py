"""Counter-based random numbers: Philox4x32-10, the `RandomUniform` node and `rand`.

`rand(shape, seed, offset)` is a tensor of float32 uniforms in [0, 1) that is a pure function of
the element's index, so it fuses into any kernel that reads it and a backward pass regenerates
what the forward pass drew (nothing is stored). Exactly (docs/training.md, "Random numbers"):

    element n (the row-major linear index) = uniform(word n mod 4 of
        Philox4x32-10(counter = (lo32(c), hi32(c), 0, 0), key = (lo32(seed), hi32(seed))))
    with c = offset + floor(n / 4)  (64-bit, wrapping)  and  uniform(x) = (x >> 8) * 2^-24

Philox4x32-R is the generator of Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy
as 1, 2, 3" (SC'11), as Random123 implements it (its known-answer vectors are the tests). One round
maps the counter (c0, c1, c2, c3) with the key (k0, k1) to

    (hi(M1 * c2) ^ c1 ^ k0,  lo(M1 * c2),  hi(M0 * c0) ^ c3 ^ k1,  lo(M0 * c0))

(32 x 32 -> 64-bit products split into high and low words); the key gains (W0, W1) between
rounds, modulo 2^32. The mapping keeps the top 24 bits, so every value is a multiple of 2^-24 in
[0, 1 - 2^-24], exact in float32 (rounded to a 16-bit float it can become 1.0: compare in float32).

This module holds the NumPy implementation the emulator and the host evaluator run
(`philox4x32`, `uniform_from_index`); the CUDA emitter prints the same steps
(tecc/codegen/philox.py), and tests/test_random.py holds both to Random123's answers.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import numpy as np

from . import dtype as dt
from .errors import DTypeError, ShapeError
from .expr import Const, Expr, ExprLike, Var, cast, const_int, free_vars, size_product, to_shape
from .tensor import Tensor, compute

# The Philox4x32 constants (Salmon et al. 2011, Table 2; Random123's PHILOX_M4x32_0/1 and
# PHILOX_W32_0/1): the round multipliers and the Weyl increments of the key schedule.
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9  # golden ratio
PHILOX_W1 = 0xBB67AE85  # sqrt(3) - 1
PHILOX_ROUNDS = 10
UNIFORM_SCALE = 2.0**-24  # uniform(x) = (x >> 8) * 2^-24
_MASK32 = np.uint64(0xFFFFFFFF)


def _mulhilo(m: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(high, low) 32-bit words of the 64-bit products m * x, x uint32."""
    product = x.astype(np.uint64) * np.uint64(m)
    return (product >> np.uint64(32)).astype(np.uint32), (product & _MASK32).astype(np.uint32)


def philox4x32(counter: Sequence[Any], key: Sequence[Any], rounds: int = PHILOX_ROUNDS) -> tuple[np.ndarray, ...]:
    """Philox4x32-`rounds` of the counter words (c0, c1, c2, c3) under the key (k0, k1): four
    uint32 arrays (the words broadcast against each other)."""
    c0, c1, c2, c3 = np.broadcast_arrays(*(np.asarray(c, dtype=np.uint32) for c in counter))
    k0, k1 = (np.asarray(k, dtype=np.uint32) for k in key)
    w0, w1 = np.uint32(PHILOX_W0), np.uint32(PHILOX_W1)
    with np.errstate(over="ignore"):  # uint32 key sums wrap modulo 2^32, as intended
        for r in range(rounds):
            if r > 0:  # the key is bumped before every round but the first
                k0, k1 = k0 + w0, k1 + w1
            hi0, lo0 = _mulhilo(PHILOX_M0, c0)
            hi1, lo1 = _mulhilo(PHILOX_M1, c2)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _as_uint64(value: Any) -> np.ndarray:
    """An int64 value (or array) as the uint64 of its two's-complement bits."""
    return np.asarray(value, dtype=np.int64).view(np.uint64)


def uniform_from_index(seed: Any, offset: Any, index: Any) -> np.ndarray:
    """The float32 uniforms of `RandomUniform(seed, offset, index)`; int64 scalars or arrays,
    broadcast against each other (the emulator's per-lane values)."""
    with np.errstate(over="ignore"):
        s, off, n = _as_uint64(seed), _as_uint64(offset), _as_uint64(index)
        group = (n.view(np.int64) >> np.int64(2)).view(np.uint64)  # floor(n / 4) (arithmetic shift)
        c = off + group  # uint64 arithmetic wraps modulo 2^64: the carry into hi32 included
        lo, hi = (c & _MASK32).astype(np.uint32), (c >> np.uint64(32)).astype(np.uint32)
        zero = np.zeros_like(lo)
        words = philox4x32((lo, hi, zero, zero), ((s & _MASK32).astype(np.uint32), (s >> np.uint64(32)).astype(np.uint32)))
        which = (n & np.uint64(3)).astype(np.intp)  # n mod 4
        x = np.choose(np.broadcast_to(which, words[0].shape), words)
    return ((x >> np.uint32(8)).astype(np.float32) * np.float32(UNIFORM_SCALE)).astype(np.float32)


class RandomUniform(Expr):
    """`rand(seed, offset, n)`: element n of the uniform stream (seed, offset), a float32 in
    [0, 1). Word n mod 4 of Philox4x32-10 with counter (lo32(c), hi32(c), 0, 0), c = offset +
    floor(n / 4) wrapping modulo 2^64, and key (lo32(seed), hi32(seed)), mapped as
    (x >> 8) * 2^-24 (the module docstring). `seed`, `offset` and `index` are int64 expressions
    (their two's-complement bits are what counts). Pure: the same operands give the same value
    on every target, so it may be computed anywhere, any number of times; four elements of one
    group floor(n / 4) share one Philox call where codegen can see it (tecc/codegen/philox.py)."""

    __slots__ = ("seed", "offset", "index")
    _fields = ("seed", "offset", "index")
    seed: Expr
    offset: Expr
    index: Expr

    def _init(self, seed: Expr, offset: Expr, index: Expr) -> None:
        for what, e in (("seed", seed), ("offset", offset), ("index", index)):
            if not isinstance(e, Expr) or e.dtype != dt.int64:
                shown = e.dtype if isinstance(e, Expr) else type(e).__name__
                raise DTypeError(f"rand: the {what} of a RandomUniform node must be an int64 expression, got {shown} "
                                 f"({e}); tc.rand builds it from ints or int64 scalars")
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "dtype", dt.float32)

    def with_children(self, children: tuple[Expr, ...]) -> "RandomUniform":
        """The node over new operands (seed, offset, index), what a mutator rebuilds."""
        seed, offset, index = children
        return RandomUniform(seed, offset, index)


def random_uniform(seed: ExprLike, offset: ExprLike, index: ExprLike) -> RandomUniform:
    """A RandomUniform node of integer operands, each widened to int64 (Python ints are taken
    modulo 2^64 as two's complement, so a seed may be given in [0, 2^64) too)."""
    args = []
    for what, v in (("seed", seed), ("offset", offset), ("index", index)):
        if isinstance(v, Expr):
            if not v.dtype.is_int:
                raise DTypeError(f"rand: the {what} must be an integer, got the {v.dtype} expression {v}")
            args.append(cast(v, dt.int64))
        elif isinstance(v, int) and not isinstance(v, bool):
            args.append(Const(dt.wrap_int(v, dt.int64), dt.int64))
        else:
            raise DTypeError(f"rand: the {what} must be an int, an int64 scalar tensor or an integer expression, "
                             f"got {type(v).__name__} {v!r}")
    return RandomUniform(*args)


def _scalar_operand(what: str, value: Any) -> ExprLike:
    """A seed or offset as an int or int64 expression: a Python int (taken modulo 2^64), an int64
    tensor of shape () or (1,) (read at run time, so a replayed CUDA graph can draw new numbers),
    or an integer expression over sizes (no axes: the same for every element)."""
    if isinstance(value, bool) or isinstance(value, (float, np.floating)):
        raise DTypeError(f"rand: the {what} must be an integer, got {type(value).__name__} {value!r}")
    if isinstance(value, (int, np.integer)):
        if not -(2**63) <= int(value) < 2**64:
            raise DTypeError(f"rand: the {what} {int(value)} does not fit 64 bits; give it modulo 2**64")
        return int(value)
    if isinstance(value, Tensor):
        dims = [const_int(s) for s in value.shape]
        if dims not in ([], [1]):
            raise ShapeError(f"rand: the {what} tensor {value.name} has shape "
                             f"({', '.join(str(s) for s in value.shape)}); give a scalar: shape () or (1,)")
        if value.dtype != dt.int64:
            raise DTypeError(f"rand: the {what} tensor {value.name} is {value.dtype}; declare it int64 "
                             f"(tc.placeholder((), 'int64', name=...))")
        return value[()] if not dims else value[0]
    if isinstance(value, Expr):
        if not value.dtype.is_int:
            raise DTypeError(f"rand: the {what} must be an integer, got the {value.dtype} expression {value}")
        axes = sorted(v.name for v in free_vars(value) if v.kind != "size")
        if axes:
            raise ShapeError(f"rand: the {what} {value} uses the axes {', '.join(axes)}; a seed or offset is one "
                             "value for the whole tensor (ints, sizes or a scalar tensor's element)")
        return value
    raise DTypeError(f"rand: the {what} must be an int, an int64 tensor of shape () or (1,), or an integer "
                     f"expression; got {type(value).__name__}")


def linear_index(axes: Sequence[Var], shape: Sequence[Expr]) -> Expr:
    """The row-major linear index of `axes` in `shape`, ((i0*s1 + i1)*s2 + i2)..., in int32 when
    the element count is (an int32 shape, as the kernel ABI assumes for int32 sizes, or a
    constant below 2^31), else int64."""
    wide = size_product(shape).dtype == dt.int64
    n: Expr = Const(0, dt.int64 if wide else dt.int32)
    for axis, extent in zip(axes, shape):
        step = cast(extent, dt.int64) if wide else extent
        n = n * step + (cast(axis, dt.int64) if wide else axis)
    return n


_names = itertools.count()


def rand(shape: Sequence[ExprLike] | ExprLike, seed: Any, offset: Any = 0, name: str | None = None) -> Tensor:
    """A tensor of float32 uniforms in [0, 1): element n (row-major) is `RandomUniform(seed,
    offset, n)` (the module docstring has the exact definition). `seed` and `offset` are ints or
    int64 tensors of shape () or (1,). The tensor is an ordinary compute: read it inside another
    compute (`tc.where(R[i, j] < p, 0, x[i, j] / (1 - p))`) and it is computed where it is read;
    nothing is stored unless it is an output."""
    shp = to_shape(shape)
    s, off = _scalar_operand("seed", seed), _scalar_operand("offset", offset)
    return compute(shp, lambda *axes: random_uniform(s, off, linear_index(axes, shp)),
                   name=name if name is not None else f"rand_{next(_names)}")
