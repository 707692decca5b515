"""The result of `build`: a compiled module you can call, inspect and save."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ..ir.errors import DeviceError, TeccError
from ..ir.stmt import Module
from ..runtime.artifact import manifest_version
from ..runtime.host import HostProgram
from .plan import Plan

MANIFEST_FORMAT = "tecc-artifact"


def _versions(nvrtc: str = "") -> dict[str, str]:
    from importlib import metadata

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "unknown"

    return {"tecc": version("tecc"), "nvrtc": nvrtc, "cuda_core": version("cuda-core")}


class Kernel:
    """A built program.

    `f(*arrays)` runs it (NumPy arrays are copied in and results copied back into them; device
    arrays are used in place). `f.sim(*arrays)` runs the same kernel IR in the CPU emulator.
    `f.source` is the CUDA C, `f.ptx` / `f.cubin` the NVRTC output, `f.resources` the ptxas
    report per kernel, `f.module` the final loop IR, `f.plan` the schedule, `f.save(path)` writes
    a deployable artifact."""

    def __init__(self, *, module: Module, host: HostProgram, source: str, plan: Plan, target: str,
                 timing: Any) -> None:
        self.module = module
        self.host = host
        self.source = source
        self.plan = plan
        self.target = target
        self.timing = timing
        self.ptx: str = ""
        self.cubin: bytes = b""
        self.resources: dict[str, Any] = {}
        self.arch: str = ""
        self.nvrtc_version: str = ""
        self.options: tuple[str, ...] = ()
        self.dump_dir: Path | None = None
        self.planning: Any = None  # the planner's PlanResult when plan="auto" (read by explain)
        self._executor: Any = None
        self._sim: Any = None

    @property
    def name(self) -> str:
        return self.module.name

    def attach_binary(self, compiled: Any, options: tuple[str, ...]) -> None:
        self.ptx = compiled.ptx
        self.cubin = compiled.cubin
        self.resources = dict(compiled.resources)
        self.arch = compiled.arch
        self.nvrtc_version = compiled.nvrtc_version
        self.options = options

    # ---- running ----------------------------------------------------------------------------
    def __call__(self, *args: Any) -> None:
        # Thin on purpose: a repeated call with device arrays is a launch-cache hit in the
        # executor (docs/runtime.md, "Repeated calls"), so this frame is most of what is left.
        executor = self._executor
        if executor is None:
            if self.target == "sim":
                return self.sim(*args)
            from ..runtime.cuda import CudaExecutor, cuda_available

            if not cuda_available():
                raise DeviceError(
                    f"{self.name}: no CUDA device is available to run this kernel; build with "
                    "target='sim' or call f.sim(...) to run it in the CPU emulator"
                )
            executor = self._executor = CudaExecutor(self.host, self.cubin)
        executor(*args)
        return None

    def sim(self, *args: Any) -> None:
        """Run the kernel IR in the CPU SIMT emulator (NumPy arrays, written in place)."""
        if self._sim is None:
            from ..runtime.sim import SimExecutor
            from . import options as knobs

            self._sim = SimExecutor(self.host, {k.name: k for k in self.module.kernels}, checks=knobs.sim_checks())
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
            "source_sha256": hashlib.sha256(self.source.encode()).hexdigest(),
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write path.cubin, path.ptx, path.cu and path.json (the manifest); returns the stem."""
        stem = Path(path)
        stem.parent.mkdir(parents=True, exist_ok=True)
        manifest = self.manifest()
        _atomic_write(stem.with_suffix(".cubin"), self.cubin)
        _atomic_write(stem.with_suffix(".ptx"), self.ptx.encode())
        _atomic_write(stem.with_suffix(".cu"), self.source.encode())
        _atomic_write(stem.with_suffix(".json"), json.dumps(manifest, indent=2).encode())
        return stem


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
