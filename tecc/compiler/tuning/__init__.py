"""The measured autotuner: the planner proposes, the GPU decides (docs/tuning.md).

    result = tune(spec, top_k=8)          # an OpSpec, or the build signature with sizes=
    result.plan                           # the fastest candidate that matched the reference
    print(result.table())                 # every candidate: predicted vs measured

`build(..., tune=True)` enters through `tuned_plan` alone. The steps, one module each, run by
tuner.py in this order:

1. **candidates** (`candidate_plans`): the planner's own plan first, then plans that move one
   kernel to one of its next `top_k` points, least predicted time first.
2. **pool** (`compile_candidates`): NVRTC in a pool of spawned processes (a CUDA context of the
   parent is never forked). Workers get the program as a `ProgramRef` and the plan as JSON, or,
   for a program that exists only in memory, the CUDA source emitted here; they compile through
   pipeline.compile_plan, never through build (the tuner sits below build).
3. **check** (`Reference`): each candidate runs once on random inputs with poisoned outputs; its
   outputs are compared with the float64 NumPy reference (`OpSpec.reference`), or, without one,
   with the naive plan's result. A candidate over the dtype's bound, or one that fails to compile
   or launch, is recorded as wrong and never wins.
4. **bench** (`CudaBench`): CUDA events around every launch, `warmup` calls, then the median of
   `repeats` calls over rotating device-resident argument sets spanning at least twice the L2
   cache, so no call finds its inputs in L2 from an earlier one.
5. **database** (`TuningDB`): every measurement (with the cost model's prediction) and the
   winner, keyed by the `Problem` (op signature, shapes, dtypes, arch, precise math) and the
   candidate's strategy. `tuned_plan` looks the problem up first and replays a stored winner
   without measuring.
"""

from .bench import L2_FACTOR, MAX_SET_BYTES, MAX_SETS, Bench, CudaBench
from .candidates import DEFAULT_TOP_K, TuneCandidate, candidate_plans
from .check import Reference
from .database import Problem, TuningDB
from .pool import CompileOutcome, ProgramRef, Progress, compile_candidates, load_op
from .tuner import (
    DEFAULT_REPEATS,
    DEFAULT_WARMUP,
    REASON_FROM_DB,
    REASON_MEASURED,
    CandidateResult,
    TuneResult,
    concrete_shapes,
    problem_of,
    require_gpu,
    tune,
    tuned_plan,
)

__all__ = [
    "DEFAULT_REPEATS", "DEFAULT_TOP_K", "DEFAULT_WARMUP", "L2_FACTOR", "MAX_SETS", "MAX_SET_BYTES",
    "REASON_FROM_DB", "REASON_MEASURED", "Bench", "CandidateResult", "CompileOutcome", "CudaBench", "Problem",
    "ProgramRef", "Progress", "Reference", "TuneCandidate", "TuneResult", "TuningDB", "candidate_plans",
    "compile_candidates", "concrete_shapes", "load_op", "problem_of", "require_gpu", "tune", "tuned_plan",
]
