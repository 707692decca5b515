"""tecc.ir: the IR levels (tensor expressions, loop-nest IR, kernel module), their printers,
visitors, targets and polyhedral analyses. Imports nothing else of tecc."""

from .dtype import (DType, as_dtype, bfloat16, bool_, float16, float32, float64, int32, int64, promote)
from .errors import (CompileError, DeviceError, DTypeError, LaunchError, OutOfBoundsError, RaceError,
                     ResourceError, ScheduleError, ShapeError, TeccError, UninitializedReadError)
from .expr import (Binary, BufferLoad, Call, Cast, Compare, Const, Expr, IterVar, Not, Reduce, ReduceAxis,
                   Select, TensorRead, Var)
from .ops import (abs, cast, ceil, const, cos, erf, exp, exp2, floor, isnan, log, log2, max, maximum, min,
                  minimum, pow, prod, rsqrt, sigmoid, sin, sqrt, sum, tanh, where)
from .stmt import (Allocate, Barrier, Buffer, BufferStore, Evaluate, For, IfThenElse, KernelCall, LetStmt,
                   Module, PrimFunc, Seq, Stmt)
from .tensor import ComputeOp, PlaceholderOp, Tensor, compute, placeholder, reduce_axis, var
