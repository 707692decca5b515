"""The tuner's step 3 (docs/tuning.md): every candidate must reproduce the float64 reference.

One draw of random inputs serves a whole tuning session. The expected outputs are the float64
NumPy reference (`OpSpec.reference`, inputs given as float64 copies), or, for a bare build
signature without one, the naive plan's result on the same device. Each candidate then runs once
on fresh copies of the inputs with NaN-poisoned outputs (tecc.compiler.check.poison), and each
output is compared by ‖out − ref‖ / ‖ref‖ against the dtype's bound (`REL_TOL`, or
`OpSpec.rel_tol`); integer and bool outputs must match exactly. A candidate over the bound is
never timed and never wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ...ir.errors import TeccError
from ...ir.tensor import Tensor
from ..check import REL_TOL, OpSpec, poison, random_array, relative_error
from .bench import Bench
from .pool import first_line


@dataclass
class Reference:
    """The inputs every candidate of one session runs on (in placeholder order) and the outputs
    it must reproduce (float64, in output order); `rel_tol` overrides the dtype's bound."""

    args: list[Tensor]
    shapes: list[tuple[int, ...]]
    inputs: list[np.ndarray]
    expected: list[np.ndarray]
    rel_tol: float | None = None

    @staticmethod
    def make(spec: OpSpec | None, args: Sequence[Tensor], shapes: list[tuple[int, ...]], rng: np.random.Generator,
             naive: Any, bench: Bench) -> Reference:
        """Draw the inputs from `rng` and compute the expected outputs: `spec.reference`, else
        (no spec) the result of running `naive` (the naive plan's kernel) on `bench`."""
        args = list(args)
        inputs = _random_inputs(spec, args, shapes, rng)
        expected = _expected_outputs(spec, args, shapes, inputs, naive, bench)
        return Reference(args, shapes, inputs, expected, spec.rel_tol if spec is not None else None)

    def arguments(self) -> list[np.ndarray]:
        """Fresh arrays in signature order: copies of the inputs, poisoned outputs."""
        return _arguments(self.args, self.shapes, self.inputs)

    def check(self, kernel: Any, bench: Bench) -> tuple[float | None, str | None]:
        """Run `kernel` once on `bench` and compare its outputs: (relative error, None) when
        every output is within its bound (the worst error), else (the failing output's error,
        what failed); (None, "run failed: ...") when it did not run."""
        arrays = self.arguments()
        try:
            bench.run(kernel, arrays)
        except Exception as exc:  # noqa: BLE001 - a candidate that faults is rejected, the others go on
            return None, f"run failed: {first_line(exc)}"
        worst = 0.0
        for t, out, ref in zip([t for t in self.args if not t.is_placeholder],
                               [a for t, a in zip(self.args, arrays) if not t.is_placeholder], self.expected):
            if t.dtype.is_float:
                err, where = relative_error(out, ref)
                bound = self.rel_tol or REL_TOL[t.dtype.name]
            else:
                err = float(np.count_nonzero(out.astype(np.float64) != ref))
                where, bound = f"{int(err)} elements differ", 0.0
            worst = max(worst, err)
            if err > bound:
                return err, f"wrong result: {t.name} rel err {err:.2e} > {bound:.0e}, {where}"
        return worst, None


def _random_inputs(spec: OpSpec | None, args: Sequence[Tensor], shapes: list[tuple[int, ...]],
                   rng: np.random.Generator) -> list[np.ndarray]:
    input_shapes = [s for t, s in zip(args, shapes) if t.is_placeholder]
    if spec is not None and spec.make_inputs is not None:
        return list(spec.make_inputs(rng, input_shapes))
    return [random_array(rng, s, t.dtype) for t, s in zip([t for t in args if t.is_placeholder], input_shapes)]


def _arguments(args: Sequence[Tensor], shapes: list[tuple[int, ...]], inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Inputs in signature order with poisoned outputs (fresh arrays each call)."""
    it = iter(inputs)
    return [next(it).copy() if t.is_placeholder else poison(s, t.dtype) for t, s in zip(args, shapes)]


def _expected_outputs(spec: OpSpec | None, args: Sequence[Tensor], shapes: list[tuple[int, ...]],
                      inputs: list[np.ndarray], naive: Any, bench: Bench) -> list[np.ndarray]:
    """The expected outputs in float64: OpSpec.reference, else the naive plan's result."""
    outputs = [t for t in args if not t.is_placeholder]
    if spec is not None:
        refs = spec.reference(*[a.astype(np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a
                                for a in inputs])
        if isinstance(refs, np.ndarray) or np.isscalar(refs):
            refs = [refs]
        out_shapes = [s for t, s in zip(args, shapes) if not t.is_placeholder]
        return [np.broadcast_to(np.asarray(r, dtype=np.float64), s) for r, s in zip(refs, out_shapes)]
    arrays = _arguments(args, shapes, inputs)
    try:
        bench.run(naive, arrays)
    except Exception as exc:  # noqa: BLE001 - reported as a TeccError that says what failed
        raise TeccError(f"the naive plan (the reference) failed to run: {first_line(exc)}") from exc
    got = [a for t, a in zip(args, arrays) if not t.is_placeholder]
    return [a.astype(np.float64) for a, _ in zip(got, outputs)]
