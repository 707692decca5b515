"""Saved artifacts: read, validate and run `kernel.save(path)` output with the runtime alone.

An artifact is four files next to each other (`path` is the stem; `load("out/axpy")` and
`load("out/axpy.json")` read the same artifact):

    path.json   the manifest (below), required
    path.cubin  the device code for the manifest's arch, required
    path.ptx    the PTX, optional (kept as text for inspection)
    path.cu     the CUDA C the cubin was compiled from, optional (kept as text)

Manifest, version 1, 2, 3, 4 or 5 (docs/runtime.md, "Artifacts", is the reference; MANIFEST_VERSION
says what 2, 3, 4 and 5 add):

    {"format": "tecc-artifact", "version": 1,
     "entry": <module name, = host["name"]>, "arch": "sm_90",
     "host": HostProgram.to_json(),
     "kernels": [{"name", "registers", "shared_bytes", "spills"}, ...],   one per host kernel
     "plan": <plan JSON or null>,
     "versions": {"tecc", "nvrtc", "cuda_core"},
     "options": [NVRTC options, ...],
     "source_sha256": <hex SHA-256 of the CUDA C source, UTF-8>}

Loading never imports tecc.passes, tecc.codegen or tecc.compiler: the manifest's `host` is all
the runtime needs (signature, temporaries, kernel parameters and launch dimensions, call
sequence). Without a GPU, `load` still reads and validates everything; calling the result
raises DeviceError.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..ir.errors import DeviceError, TeccError
from ..ir.target import Target
from ..ir.target import target as target_table
from . import cuda
from .host import HostProgram
from .runnable import RunnableKernel

MANIFEST_FORMAT = "tecc-artifact"
# The newest format version this runtime reads (it reads every older one too):
#   1  the format above;
#   2  a temporary in host["temps"] may carry "zero_init": true (zero it once when allocated; its
#      kernels leave it zero), which a version-1 reader would ignore and so run wrongly;
#   3  a kernel in host["kernels"] may carry "tensor_maps" (TMA: by-value CUtensorMap parameters
#      the runtime encodes at each launch from the arrays, tensor_map.py), which an older reader
#      would ignore and launch the kernel without;
#   4  a tensor map may carry "merge" (runs of the array's dimensions it sees as one), which a
#      version-3 reader would ignore and encode a map of the wrong rank;
#   5  a kernel in host["kernels"] may carry "entry": the cubin's function that runs it, another
#      kernel's whose code is its own up to names, compiled once (tecc/codegen/twins.py); an
#      older reader would look for a function of the kernel's own name, which the cubin lacks.
# A manifest is written with the lowest version that holds it (`manifest_version`), so a
# kernel with no such temporary stays loadable by version-1 runtimes.
MANIFEST_VERSION = 5
REQUIRED_KEYS = ("format", "version", "entry", "arch", "host", "kernels", "plan", "versions", "options",
                 "source_sha256")
VERSION_KEYS = ("tecc", "nvrtc", "cuda_core")
KERNEL_STAT_KEYS = ("name", "registers", "shared_bytes", "spills")

# sm_90, sm_90a (arch-specific: runs on 9.0 only), sm_100f (family-specific).
_ARCH = re.compile(r"^sm_(\d+)(\d)([af]?)$")


class ArtifactError(TeccError):
    """A saved artifact is missing, malformed, or of a format version this runtime cannot read."""


def artifact_paths(path: str | os.PathLike[str]) -> dict[str, Path]:
    """The files of the artifact whose stem (or manifest path) is `path`: the manifest, cubin,
    PTX, CUDA C, and the final loop IR (`ir`, what the emulator runs: tecc.ir.loop_json)."""
    stem = Path(path)
    files = {suffix: stem.with_suffix(f".{suffix}") for suffix in ("json", "cubin", "ptx", "cu")}
    files["ir"] = stem.with_suffix(".ir")
    return files


def source_sha256(source: str) -> str:
    """The manifest's `source_sha256` of a CUDA C source text."""
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def parse_arch(arch: str) -> tuple[int, int, str]:
    """(major, minor, suffix) of an `sm_XY[a|f]` name; ArtifactError if malformed."""
    m = _ARCH.match(arch) if isinstance(arch, str) else None
    if m is None:
        raise ArtifactError(f"arch {arch!r} is not of the form sm_XY (e.g. sm_90)")
    return int(m.group(1)), int(m.group(2)), m.group(3)


def cubin_runs_on(arch: str, compute_capability: tuple[int, int]) -> bool:
    """Whether a cubin compiled for `arch` runs on a device of `compute_capability`.

    CUDA's rule for binaries (CUDA C++ Programming Guide, "Binary Compatibility"): a cubin for
    sm_XY runs on devices X.Z with Z >= Y, never on another major version; an arch-specific
    cubin (sm_XYa) runs on X.Y only; a family-specific one (sm_XYf) like a plain one here."""
    major, minor, suffix = parse_arch(arch)
    dev_major, dev_minor = compute_capability
    if suffix == "a":
        return (major, minor) == (dev_major, dev_minor)
    return major == dev_major and dev_minor >= minor


def manifest_version(host: HostProgram) -> int:
    """The lowest format version that holds `host` (see MANIFEST_VERSION)."""
    if any(k.entry for k in host.kernels):
        return 5
    if any(m.merge for k in host.kernels for m in k.tensor_maps):
        return 4
    if any(k.tensor_maps for k in host.kernels):
        return 3
    return 2 if any(t.zero_init for t in host.temps) else 1


def validate_manifest(manifest: Any, where: str = "manifest") -> HostProgram:
    """Check a manifest against its format version (1..4) and return its HostProgram.

    Raises ArtifactError naming the offending key."""
    if not isinstance(manifest, Mapping):
        raise ArtifactError(f"{where}: expected a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ArtifactError(f"{where}: not a tecc artifact (format is {manifest.get('format')!r}, "
                            f"expected {MANIFEST_FORMAT!r})")
    version = manifest.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ArtifactError(f"{where}: malformed format version {version!r}")
    if version > MANIFEST_VERSION:
        raise ArtifactError(
            f"{where}: written with artifact format version {version}, but this runtime reads versions "
            f"up to {MANIFEST_VERSION}; upgrade tecc, or rebuild and save the kernel with this version"
        )
    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing:
        raise ArtifactError(f"{where}: missing key(s) {', '.join(missing)}")
    parse_arch(manifest["arch"])
    if not isinstance(manifest["entry"], str) or not manifest["entry"]:
        raise ArtifactError(f"{where}: 'entry' must be the module name, got {manifest['entry']!r}")
    versions = manifest["versions"]
    if not isinstance(versions, Mapping) or any(k not in versions for k in VERSION_KEYS):
        raise ArtifactError(f"{where}: 'versions' must be an object with keys {', '.join(VERSION_KEYS)}")
    if not isinstance(manifest["options"], list) or not all(isinstance(o, str) for o in manifest["options"]):
        raise ArtifactError(f"{where}: 'options' must be a list of strings")
    digest = manifest["source_sha256"]
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ArtifactError(f"{where}: 'source_sha256' must be 64 lowercase hex digits, got {digest!r}")

    try:
        host = HostProgram.from_json(manifest["host"])
    except TeccError as exc:
        raise ArtifactError(f"{where}: malformed 'host' program: {exc}") from exc
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ArtifactError(f"{where}: malformed 'host' program ({type(exc).__name__}: {exc})") from exc
    if host.name != manifest["entry"]:
        raise ArtifactError(f"{where}: 'entry' is {manifest['entry']!r} but the host program is {host.name!r}")

    stats = manifest["kernels"]
    if not isinstance(stats, list) or not all(isinstance(k, Mapping) for k in stats):
        raise ArtifactError(f"{where}: 'kernels' must be a list of objects")
    for k in stats:
        absent = [key for key in KERNEL_STAT_KEYS if key not in k]
        if absent:
            raise ArtifactError(f"{where}: kernel entry {k.get('name', '?')!r} lacks {', '.join(absent)}")
    listed = sorted(str(k["name"]) for k in stats)
    expected = sorted(k.name for k in host.kernels)
    if listed != expected:
        raise ArtifactError(f"{where}: 'kernels' lists {listed} but the host program has kernels {expected}")
    if version < manifest_version(host):
        raise ArtifactError(f"{where}: format version {version} cannot hold this host program (a zero_init "
                            f"temporary, tensor maps or a kernel's entry need version {manifest_version(host)} and up)")
    return host


def write_artifact(path: str | os.PathLike[str], manifest: Mapping[str, Any], cubin: bytes, *,
                   ptx: str | None = None, cuda_source: str | None = None, loop_ir: str | None = None) -> Path:
    """Validate `manifest` and write the artifact's files (atomically each); returns the stem.

    The compiler's `Kernel.save` writes through this; tests use it to make artifacts by hand."""
    validate_manifest(manifest)
    files = artifact_paths(path)
    files["json"].parent.mkdir(parents=True, exist_ok=True)
    write_atomically(files["cubin"], bytes(cubin))
    if ptx is not None:
        write_atomically(files["ptx"], ptx.encode("utf-8"))
    if cuda_source is not None:
        write_atomically(files["cu"], cuda_source.encode("utf-8"))
    if loop_ir is not None:
        write_atomically(files["ir"], loop_ir.encode("utf-8"))
    write_atomically(files["json"], json.dumps(manifest, indent=2).encode("utf-8"))
    return Path(path)


def write_atomically(path: Path, data: bytes) -> None:
    """`data` written to a temporary beside `path`, then renamed over it: a reader sees the old
    file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed (not yet validated) manifest of the artifact at `path`."""
    file = artifact_paths(path)["json"]
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ArtifactError(f"no tecc artifact at {file}: the manifest file does not exist "
                            "(write one with kernel.save(path))") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{file}: not valid JSON ({exc})") from exc
    return manifest  # type: ignore[no-any-return]


class LoadedKernel(RunnableKernel):
    """A saved artifact, ready to run on the GPU with the runtime alone.

    `f(*arrays)` runs it like the built kernel (RunnableKernel: arrays in `host.buffer_params`
    order; NumPy arrays copied in and results copied back, device arrays used in place). The
    CUDA executor is made on first call (or by `executor`); without a usable GPU, or on one that
    cannot run the cubin's arch, that raises DeviceError. `manifest`, `host`, `cubin`, `ptx`,
    `cuda_source`, `plan`, `arch` and `kernel_stats` give what the artifact holds."""

    def __init__(self, path: Path, manifest: dict[str, Any], host: HostProgram, cubin: bytes,
                 ptx: str | None, cuda_source: str | None, *, stream: Any = None, debug_sync: bool = False) -> None:
        super().__init__(host, cubin, ptx, str(manifest["arch"]), stream=stream, debug_sync=debug_sync)
        self.path = path
        self.manifest = manifest
        self.cuda_source = cuda_source
        self._sim: Any = None

    @property
    def plan(self) -> Any:
        return self.manifest["plan"]

    @property
    def kernel_stats(self) -> list[dict[str, Any]]:
        """The ptxas report per kernel: name, registers, shared_bytes, spills."""
        return list(self.manifest["kernels"])

    @property
    def source_matches(self) -> bool | None:
        """Whether path.cu hashes to the manifest's source_sha256 (None when path.cu is absent)."""
        if self.cuda_source is None:
            return None
        return source_sha256(self.cuda_source) == str(self.manifest["source_sha256"])

    def _no_device_message(self, reason: str) -> str:
        return (f"{self.name}: no CUDA device is available to run the artifact {self.path} ({reason}); "
                "run it on a machine with an NVIDIA GPU, or call .sim(...) to run its loop IR in the CPU emulator")

    def _simulate(self, args: Sequence[Any]) -> None:
        """`sim(...)` (RunnableKernel): the artifact's final loop IR (`path.ir`) in the CPU SIMT
        emulator, as `Kernel.sim` runs a built kernel's."""
        if self._sim is None:
            from ..ir.loop_json import module_from_json
            from .sim import SimExecutor

            file = artifact_paths(self.path)["ir"]
            try:
                text = file.read_text(encoding="utf-8")
            except FileNotFoundError:
                raise ArtifactError(f"{self.path} has no loop IR for the emulator ({file} does not exist: the "
                                    "artifact was saved by an older tecc); save the kernel again") from None
            module = module_from_json(text, str(file))
            self._sim = SimExecutor(self.host, {k.name: k for k in module.kernels}, target=_target_of(self.arch))
        self._sim(*args)

    def _check_device(self) -> None:
        check_arch(self.arch, cuda.current_device(), self.path)

    def __repr__(self) -> str:
        return f"<tecc.LoadedKernel {self.name} arch={self.arch} kernels={[k.name for k in self.host.kernels]} from {self.path}>"


def check_arch(arch: str, device: Any, path: Any = "") -> None:
    """DeviceError unless a cubin for `arch` runs on cuda.core `device`; says what to rebuild with."""
    cc = device.compute_capability
    major, minor = int(cc[0]), int(cc[1])
    if not cubin_runs_on(arch, (major, minor)):
        where = f"the artifact {path}" if path else "the cubin"
        raise DeviceError(
            f"{where} was compiled for {arch}, but CUDA device {device.device_id} ({device.name}) is "
            f"sm_{major}{minor} and cannot run it; rebuild it with arch='sm_{major}{minor}' and save it again"
        )


def _target_of(arch: str) -> Target | None:
    """The reference Target of the artifact's arch, whose shared-memory limit the emulator holds
    launches to; None for an arch tecc has no table for (no such check)."""
    try:
        return target_table(arch)
    except ValueError:
        return None


def load(path: str | os.PathLike[str], *, stream: Any = None, debug_sync: bool = False) -> LoadedKernel:
    """Read and validate the artifact at `path` (its stem, or its .json) and return a callable.

    Checks the manifest's format and version, the host program, and that the cubin exists; when
    a GPU is present, also that the cubin's arch runs on it (DeviceError saying which `arch=` to
    rebuild with). Imports nothing of the compiler."""
    files = artifact_paths(path)
    manifest = read_manifest(path)
    host = validate_manifest(manifest, str(files["json"]))
    try:
        cubin = files["cubin"].read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"{files['json']} names no device code: {files['cubin']} does not exist") from None
    if not cubin.startswith(b"\x7fELF"):
        raise ArtifactError(f"{files['cubin']} is not a cubin (no ELF header)")
    ptx = _read_text(files["ptx"])
    cuda_source = _read_text(files["cu"])
    kernel = LoadedKernel(files["json"].with_suffix(""), manifest, host, cubin, ptx, cuda_source,
                          stream=stream, debug_sync=debug_sync)

    if cuda.cuda_available():
        check_arch(kernel.arch, cuda.current_device(), kernel.path)
    return kernel


def _read_text(file: Path) -> str | None:
    try:
        return file.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
