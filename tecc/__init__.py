"""tecc: a tensor-expression compiler for NVIDIA GPUs with a pure-Python front end.

    import tecc as tc
    A = tc.placeholder((M, K), "float32", name="A")
    ...
    f = tc.build([A, B, C], target="cuda")
"""

from .compiler import Kernel, OpSpec, Plan, Step, build, gpu_available, load
from .ir import (DType, bfloat16, bool_, float16, float32, float64, int32, int64)
from .ir.errors import (CompileError, DeviceError, DTypeError, LaunchError, OutOfBoundsError, RaceError,
                        ResourceError, ScheduleError, ShapeError, TeccError, UninitializedReadError)
from .ir.ops import (abs, cast, ceil, const, cos, erf, exp, exp2, floor, isnan, log, log2, max, maximum, min,
                     minimum, pow, prod, rsqrt, sigmoid, sin, sqrt, sum, tanh, where)
from .ir.tensor import Tensor, compute, placeholder, reduce_axis, var

__version__ = "0.1.0"
