"""tecc: a tensor-expression compiler for NVIDIA GPUs with a pure-Python front end.

    import tecc as tc
    A = tc.placeholder((M, K), "float32", name="A")
    ...
    f = tc.build([A, B, C], target="cuda")

The language (placeholder, compute, reductions, math, `grad`) is imported eagerly; the compiler
(build, load, ...) on first use, so a deployment that only loads saved artifacts through
`tecc.runtime` never imports the compiler, NVRTC or islpy. `tc.torch` (kernels as PyTorch ops,
docs/pytorch.md) imports torch, on first use only.
"""

from typing import Any

from .ir import DType, bfloat16, bool_, float8_e4m3, float8_e5m2, float16, float32, float64, int32, int64
from .ir.target import Target
from .ir.target import target_api as target
from .ir.errors import (CompileError, DeviceError, DivergenceError, DTypeError, GradientError, InvalidNameError,
                        LaunchError, OutOfBoundsError, RaceError, ResourceError, ScheduleError, ShapeError, TeccError,
                        UninitializedReadError)
from .ir.ops import (abs, cast, ceil, const, cos, erf, exp, exp2, floor, fmax, fmin, isnan, log, log2, max, maximum,
                     min, minimum, nanmax, nanmin, pow, prod, rsqrt, sigmoid, sin, sqrt, sum, tanh, where)
from .ir.expr import Expr  # a scalar expression (what a compute's lambda returns): for annotations
from .ir.tensor import Tensor, compute, placeholder, reduce_axis, var
from .ir.philox import rand
from .ir.scatter import scatter_add
from .ir.autodiff import Gradients, grad

from .version import __version__

_COMPILER_NAMES = ("build", "load", "gpu_available", "Kernel", "OpSpec", "Plan", "Step", "Schedule", "LoopRV", "StageRV", "profile",
                   "default_plan", "explain", "plan_program")


def __getattr__(name: str) -> Any:
    if name in _COMPILER_NAMES:
        from . import compiler

        return getattr(compiler, name)
    if name == "torch":  # tecc kernels as PyTorch ops; imports torch, so only on first use
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            raise ImportError(f"tc.torch needs PyTorch, which cannot be imported ({exc}); "
                              "install it (from a tecc checkout: `pip install -e '.[torch]'`; or `pip install torch`)") from exc
        import importlib

        return importlib.import_module(".torch", __name__)  # not `from . import`: that asks this hook again
    raise AttributeError(f"module 'tecc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_COMPILER_NAMES))
