"""The SIMT emulator: runs the lowered loop IR of a kernel on the CPU with GPU semantics.

All threads of a chunk of blocks are NumPy vector lanes and every statement runs for all of
them at once, so `__syncthreads()` holds by construction, divergent branches are lane masks,
shared memory is one copy per block and local memory one per lane. With `checks` on it reports
what a GPU would not: out-of-bounds accesses, shared-memory races and uninitialized reads.
How it works and how to add an intrinsic: docs/emulator.md.
"""

from ...ir.errors import (
           DivergenceError,
           OutOfBoundsError,
           RaceError,
           UninitializedReadError,
)
from .executor import SimExecutor
from .kernel import compile_kernel, simulate_kernel

__all__ = ["simulate_kernel", "SimExecutor", "compile_kernel", "DivergenceError", "OutOfBoundsError",
           "RaceError", "UninitializedReadError"]
