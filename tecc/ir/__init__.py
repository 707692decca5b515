"""tecc.ir: the IR levels (tensor expressions, loop-nest IR, kernel module), their printers,
visitors, targets and polyhedral analyses. Imports nothing else of tecc."""

from .dtype import (DType, as_dtype, bfloat16, bool_, float8_e4m3, float8_e5m2, float16, float32, float64, int32, int64,
                    promote)
from .errors import (CompileError, DeviceError, DTypeError, InvalidNameError, LaunchError, OutOfBoundsError, RaceError,
                     ResourceError, ScheduleError, ShapeError, TeccError, UninitializedReadError)
from .expr import (Binary, BufferLoad, Call, Cast, Compare, Const, Expr, IterVar, Not, Reduce, ReduceAxis, Select,
                   TensorRead, Var)
from .ops import (abs, cast, ceil, const, cos, erf, exp, exp2, floor, fmax, fmin, isnan, log, log2, max, maximum, min,
                  minimum, nanmax, nanmin, pow, prod, rsqrt, sigmoid, sin, sqrt, sum, tanh, where)
from .philox import RandomUniform, rand
from . import printer as printer  # fills the print rules `str(node)` uses (tecc.ir.printing)
from .descriptor import MatrixDescriptor
from .intrinsics import MatrixIntrinsic
from .layout import Coord, Layout, Swizzle
from .stmt import (Allocate, AsyncCommit, AsyncCopy, AsyncWait, Barrier, Buffer, BufferStore, Evaluate, For,
                   FragmentRef, IfThenElse, KernelCall, LetStmt, MatrixLoad, MatrixMultiply, Module, PrimFunc, Seq,
                   Stmt)
from .tensor import ComputeOp, PlaceholderOp, Tensor, compute, placeholder, reduce_axis, var
from .index_checks import IndexCheck
from .scatter import ScatterOp, scatter_add
