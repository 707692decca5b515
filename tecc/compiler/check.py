"""Checking a built op against NumPy: fresh random inputs, poisoned outputs, float64 reference.

An `OpSpec` is how a file declares an op for `tecc compile` / `tecc run` and for the tests:
its build signature, the sizes of its symbolic dimensions, and a NumPy reference. `check`
builds it, runs it (GPU or emulator), and compares every output with the reference by the
relative error ‖out − ref‖ / ‖ref‖ against a bound per dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..ir import dtype as dt
from ..ir.errors import TeccError
from ..ir.evaluate import evaluate_int
from ..ir.expr import free_vars
from ..ir.tensor import ComputeOp, Tensor, check_name

# ‖out − ref‖ / ‖ref‖ bounds. fp32 arithmetic lands far below 1e-5 for the reductions in the
# examples; half types are bounded by their storage rounding (2^-11, 2^-8) times a small factor.
REL_TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


@dataclass
class OpSpec:
    """An op as a file declares it: `args` is the build signature (inputs and outputs in order),
    `sizes` the values of its symbolic dimensions for checking, `reference(*inputs)` returns the
    outputs computed by NumPy in float64 (inputs arrive as float64 copies), `make_inputs(rng,
    shapes)` may replace the default random inputs (uniform in [-1, 1), small integers)."""

    name: str
    args: Sequence[Tensor]
    reference: Callable[..., Any]
    sizes: Mapping[str, int] = field(default_factory=dict)
    make_inputs: Callable[[np.random.Generator, list[tuple[int, ...]]], list[np.ndarray]] | None = None
    rel_tol: float | None = None

    def __post_init__(self) -> None:
        # the name is a file stem under `tecc compile -o DIR` and a dump directory: an ASCII
        # identifier can never name a path outside DIR
        check_name("op", self.name)

    @property
    def inputs(self) -> list[Tensor]:
        return [t for t in self.args if t.is_placeholder]

    @property
    def outputs(self) -> list[Tensor]:
        return [t for t in self.args if isinstance(t.op, ComputeOp)]

    def shapes(self, sizes: Mapping[str, int] | None = None) -> list[tuple[int, ...]]:
        """Concrete shapes of every argument for these sizes."""
        sizes = dict(self.sizes) | dict(sizes or {})
        out = []
        for t in self.args:
            env = {}
            for s in t.shape:
                for v in free_vars(s):
                    if v.name not in sizes:
                        raise TeccError(f"op {self.name}: no size given for {v.name}; put it in OpSpec.sizes")
                    env[v] = sizes[v.name]
            out.append(tuple(evaluate_int(s, env) for s in t.shape))
        return out


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: dt.DType) -> np.ndarray:
    if dtype.is_float:
        return rng.uniform(-1.0, 1.0, size=shape).astype(dtype.numpy)
    if dtype.is_bool:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    return rng.integers(-50, 50, size=shape).astype(dtype.numpy)


def poison(shape: tuple[int, ...], dtype: dt.DType) -> np.ndarray:
    """An output array filled with a value no correct kernel writes everywhere (NaN / sentinel)."""
    if dtype.is_float:
        return np.full(shape, np.nan, dtype=dtype.numpy)
    if dtype.is_bool:
        return np.zeros(shape, dtype=np.bool_)
    return np.full(shape, np.iinfo(dtype.numpy).min + 7, dtype=dtype.numpy)


@dataclass
class CheckResult:
    """Per output: the error, its bound and where it is worst. `refused` says why the outputs could
    not be compared at all (the reference returned the wrong number of arrays or a shape that is
    not the output's): the check then fails with that one line."""

    op: str
    target: str
    errors: dict[str, float]
    tolerances: dict[str, float]
    worst: dict[str, str]
    refused: str = ""

    @property
    def ok(self) -> bool:
        return not self.refused and all(self.errors[k] <= self.tolerances[k] for k in self.errors)

    def __str__(self) -> str:
        if self.refused:
            return f"{self.op} [{self.target}] FAIL: {self.refused}"
        parts = [f"{k}: rel err {self.errors[k]:.2e} (bound {self.tolerances[k]:.0e}){'' if self.errors[k] <= self.tolerances[k] else ' FAIL ' + self.worst[k]}"
                 for k in self.errors]
        return f"{self.op} [{self.target}] " + "; ".join(parts)


def relative_error(out: np.ndarray, ref: np.ndarray) -> tuple[float, str]:
    """‖out − ref‖ / ‖ref‖ (NaN anywhere counts as infinite), and the worst element."""
    o = out.astype(np.float64)
    r = ref.astype(np.float64)
    if o.size == 0:
        return 0.0, ""
    diff = np.abs(o - r)
    if not np.all(np.isfinite(o)) and not np.array_equal(np.isfinite(o), np.isfinite(r)):
        bad = np.argwhere(~np.isfinite(o) & np.isfinite(r))
        where = tuple(int(x) for x in bad[0]) if len(bad) else ()
        return float("inf"), f"non-finite output at {where}: {o[where] if where else o}"
    diff = np.where(np.isfinite(r), diff, 0.0)
    denom = np.linalg.norm(np.where(np.isfinite(r), r, 0.0))
    err = float(np.linalg.norm(diff) / (denom if denom > 0 else 1.0))
    worst = np.unravel_index(int(np.argmax(diff)), diff.shape) if diff.ndim else ()
    return err, f"worst at {tuple(int(x) for x in worst)}: got {float(o[worst])!r}, want {float(r[worst])!r}"


def run_and_compare(spec: OpSpec, kernel: Any, *, sizes: Mapping[str, int] | None = None, seed: int | None = None,
                    use_sim: bool = False) -> CheckResult:
    """Run `kernel` (built from `spec.args`) on fresh random inputs and compare with the reference."""
    rng = np.random.default_rng(seed)
    shapes = spec.shapes(sizes)
    arrays: list[np.ndarray] = []
    input_shapes = [s for t, s in zip(spec.args, shapes) if t.is_placeholder]
    inputs = (spec.make_inputs(rng, input_shapes) if spec.make_inputs is not None
              else [random_array(rng, s, t.dtype) for t, s in zip(spec.inputs, input_shapes)])
    it = iter(inputs)
    for t, s in zip(spec.args, shapes):
        arrays.append(next(it) if t.is_placeholder else poison(s, t.dtype))
    refs = spec.reference(*[a.astype(np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a
                            for a in inputs])
    if not isinstance(refs, (list, tuple)):  # one array (or scalar) for the one output
        refs = [refs]
    target = "sim" if use_sim or getattr(kernel, "target", "") == "sim" else "cuda"
    (kernel.sim if use_sim else kernel)(*arrays)
    outs = [a for t, a in zip(spec.args, arrays) if not t.is_placeholder]
    refused = _reference_mismatch(spec, outs, refs)
    if refused:
        return CheckResult(spec.name, target, {}, {}, {}, refused)
    errors, tols, worst = {}, {}, {}
    for t, out, ref in zip(spec.outputs, outs, refs):
        ref_arr = np.broadcast_to(np.asarray(ref, dtype=np.float64), out.shape)
        if t.dtype.is_float:
            err, w = relative_error(out, ref_arr)
            tol = spec.rel_tol or REL_TOL[t.dtype.name]
        else:
            mismatch = out.astype(np.float64) != ref_arr
            err = float(np.count_nonzero(mismatch))
            idx = tuple(int(x) for x in np.argwhere(mismatch)[0]) if err else ()
            w = f"first mismatch at {idx}: got {out[idx]!r}, want {ref_arr[idx]!r}" if err else ""
            tol = 0.0
        errors[t.name], tols[t.name], worst[t.name] = err, tol, w
    return CheckResult(spec.name, target, errors, tols, worst)


def _reference_mismatch(spec: OpSpec, outs: list[np.ndarray], refs: Sequence[Any]) -> str:
    """Why the reference's results cannot be compared with the outputs ("" when they can): the
    reference is the user's code, so a wrong count or shape fails the check with both named."""
    names = [t.name for t in spec.outputs]
    if len(refs) != len(outs):
        return (f"the reference returned {len(refs)} array(s) for {len(outs)} output(s) "
                f"({', '.join(names)}); return one array per output, in signature order")
    for name, out, ref in zip(names, outs, refs):
        shape = np.shape(ref)
        try:  # a reference may return a scalar or an array that broadcasts to the output
            fits = np.broadcast_shapes(shape, out.shape) == out.shape
        except ValueError:
            fits = False
        if not fits:
            return (f"the reference returned shape {shape} for output {name}, whose shape is "
                    f"{out.shape}; fix the reference (or the op's sizes)")
    return ""
