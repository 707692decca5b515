"""The result of `build`: a compiled module you can call, inspect and save.

The runnable part (host program, cubin, PTX, arch, the CUDA executor and the call path) is
`tecc.runtime.runnable.RunnableKernel`, shared with what `tecc.load` returns; `Kernel` adds what
only the compiler has: the loop IR, the plan, the CUDA C, the ptxas report, timing, the
emulator, `explain` and `save`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

from ..ir.errors import TeccError
from ..ir.stmt import Module
from ..runtime.artifact import MANIFEST_FORMAT, manifest_version, source_sha256, write_artifact
from ..runtime.host import HostProgram
from ..runtime.runnable import RunnableKernel
from .plan import Plan


def _versions(nvrtc: str = "") -> dict[str, str]:
    from importlib import metadata

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "unknown"

    return {"tecc": version("tecc"), "nvrtc": nvrtc, "cuda_core": version("cuda-core")}


class Kernel(RunnableKernel):
    """A built program.

    `f(*arrays)` runs it (NumPy arrays are copied in and results copied back into them; device
    arrays are used in place). `f.sim(*arrays)` runs the same kernel IR in the CPU emulator.
    `f.source` is the CUDA C, `f.ptx` / `f.cubin` the NVRTC output, `f.resources` the ptxas
    report per kernel, `f.module` the final loop IR, `f.plan` the schedule, `f.save(path)` writes
    a deployable artifact. `f.executor` and `f.synchronize()` are those of every RunnableKernel."""

    ptx: str  # "" until attach_binary (a build for target "sim" has none)

    def __init__(self, *, module: Module, host: HostProgram, source: str, plan: Plan, target: str,
                 timing: Any) -> None:
        super().__init__(host, b"", "", "")
        self.module = module
        self.source = source
        self.plan = plan
        self.target = target
        self.timing = timing
        self.resources: dict[str, Any] = {}
        self.nvrtc_version: str = ""
        self.compile_log = ""
        self.options: tuple[str, ...] = ()
        self.dump_dir: Path | None = None
        self.planning: Any = None  # the planner's PlanResult when plan="auto" (read by explain)
        # a build-cache hit has no PlanResult: the report of the build that planned it (explain)
        self.planning_report: str | None = None
        # plan="auto" candidates that took the program but failed to build: (candidate, why)
        self.fallbacks: list[tuple[str, str]] = []
        self._sim: Any = None
        # the arch the build was asked for (None: TECC_ARCH, else the live device, else sm_90):
        # the emulator holds a launch to that GPU's shared-memory limit (`_simulate`)
        self.build_arch: str | None = None

    def attach_binary(self, compiled: Any, options: tuple[str, ...]) -> None:
        self.ptx = compiled.ptx
        self.cubin = compiled.cubin
        self.resources = dict(compiled.resources)
        self.arch = compiled.arch
        self.compile_log = compiled.log  # NVRTC's and ptxas's messages (warnings included)
        self.nvrtc_version = compiled.nvrtc_version
        self.options = options

    # ---- running ----------------------------------------------------------------------------
    def _runner(self) -> Callable[..., None]:
        # built for "sim": every call runs in the emulator (no executor is kept, so the tuner
        # may attach a binary and switch `target` to "cuda" later)
        if self.target == "sim":
            return self.sim
        return self.executor

    def _no_device_message(self, reason: str) -> str:
        return (f"{self.name}: no CUDA device is available to run this kernel; build with "
                "target='sim' or call f.sim(...) to run it in the CPU emulator")

    def _runs_in_emulator(self) -> bool:
        return self.target == "sim"

    def _simulate(self, args: Sequence[Any]) -> None:
        """`f.sim(...)` (RunnableKernel: the outputs may be left out): the kernel IR in the CPU
        SIMT emulator, NumPy arrays written in place."""
        if self._sim is None:
            from ..runtime.sim import SimExecutor
            from . import options as knobs
            from .program import resolve_target

            # the GPU the build planned for (program.resolve_target, as build resolves it), whose
            # per-block shared-memory limit the emulator holds each launch to
            device = resolve_target(self.build_arch or self.arch or knobs.default_arch_override())
            self._sim = SimExecutor(self.host, {k.name: k for k in self.module.kernels}, checks=knobs.sim_checks(),
                                    target=device)
        self._sim(*args)

    # ---- inspection -------------------------------------------------------------------------
    def explain(self) -> str:
        """The plan and why: chosen strategy and parameters, the cost breakdown, the runners-up
        and the rejected points (when the planner chose it); then each kernel's launch shape and
        ptxas report."""
        from .explain import explain_kernel

        return explain_kernel(self)

    def __repr__(self) -> str:
        return f"<tecc.Kernel {self.name} target={self.target} arch={self.arch or '-'} kernels={len(self.module.kernels)}>"

    # ---- artifacts --------------------------------------------------------------------------
    def manifest(self) -> dict[str, Any]:
        if not self.cubin:
            raise TeccError(f"{self.name}: only kernels built for target='cuda' have a cubin to save")
        kernels = []
        for k in self.host.kernels:
            res = self.resources.get(k.name)
            kernels.append({
                "name": k.name,
                "registers": getattr(res, "registers", None),
                "shared_bytes": getattr(res, "shared_bytes", None),
                "spills": (getattr(res, "spill_stores", 0) or 0) + (getattr(res, "spill_loads", 0) or 0)
                if res is not None else None,
            })
        return {
            "format": MANIFEST_FORMAT,
            "version": manifest_version(self.host),  # 1, or 2 with a zero_init temporary
            "entry": self.name,
            "arch": self.arch,
            "host": self.host.to_json(),
            "kernels": kernels,
            "plan": self.plan.to_dict(),
            "versions": _versions(self.nvrtc_version),
            "options": list(self.options),
            "source_sha256": source_sha256(self.source),
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write path.cubin, path.ptx, path.cu, path.json (the manifest) and path.ir (the loop
        IR, for `tecc.load(path).sim(...)`); returns the stem."""
        from ..ir.loop_json import module_to_json

        return write_artifact(path, self.manifest(), self.cubin, ptx=self.ptx, cuda_source=self.source,
                              loop_ir=module_to_json(self.module))
