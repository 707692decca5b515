"""The pass manager: runs a readable, linear list of named passes over a Module, with instruments.

Instruments see the module after every pass:
- `DumpIR(dir, kernel_filter)` writes `NN_<pass>.txt` (the whole module, or only the kernels whose
  name contains the filter; nothing for a module with no such kernel);
- `PassTiming` records the seconds each pass took;
- `VerifyIR` checks the IR's invariants after each pass, so a pass that breaks one is named.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from ..ir.errors import TeccError
from ..ir.stmt import Module


@dataclass(frozen=True)
class Pass:
    """A named pure function Module → Module with its parameters (shown in dumps and timings)."""

    name: str
    fn: Callable[[Module], Module]
    params: tuple[tuple[str, Any], ...] = ()

    def __call__(self, module: Module) -> Module:
        return self.fn(module)


class Instrument(Protocol):
    def after_pass(self, index: int, p: Pass, module: Module, seconds: float) -> None: ...


class DumpIR:
    """Writes the IR after every pass into `directory` as numbered text files.

    With a `kernel_filter`, a file holds only the kernels whose name contains it, and a module
    none of whose kernels match writes nothing at all (no directory, no `.cu`, no `.ptx`): `text`
    decides, for the module it was last given, whether the next `write` happens. The numbering
    counts every step either way, so a file's number is its step's."""

    def __init__(self, directory: str | os.PathLike[str], kernel_filter: str | None = None) -> None:
        self.directory = Path(directory)
        self.kernel_filter = kernel_filter
        if not kernel_filter:  # made now, so an unusable directory is an error before the build
            self.directory.mkdir(parents=True, exist_ok=True)
        self.count = 0
        self.matches = True  # whether the module last given to `text` has a kernel the filter keeps

    def text(self, module: Module) -> str:
        if not self.kernel_filter:
            return str(module)
        kept = [k for k in module.kernels if self.kernel_filter in k.name]
        self.matches = bool(kept)
        return "\n\n".join(str(k) for k in kept)

    def write(self, stem: str, text: str) -> Path | None:
        """Write `NN_<stem>` (None, and nothing written, for a module the filter does not keep)."""
        path = self.directory / f"{self.count:02d}_{stem}"
        self.count += 1
        if not self.matches:
            return None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TeccError(f"cannot write the IR dumps to {self.directory} ({exc.strerror or exc}); give "
                            "dump_ir (or TECC_DUMP_IR) a directory that can be created and written") from exc
        path.write_text(text if text.endswith("\n") else text + "\n")
        return path

    def rewind(self, first: int) -> None:
        """Remove the dumps numbered `first` and later (a plan that failed half-way through, which
        the build then replaces), so that the next files are numbered from `first` again."""
        for path in (self.directory.iterdir() if self.directory.is_dir() else ()):
            number = path.name.split("_", 1)[0]
            if number.isdigit() and int(number) >= first and path.is_file():
                path.unlink()
        self.count = first

    def after_pass(self, index: int, p: Pass, module: Module, seconds: float) -> None:
        params = "".join(f"  # {k} = {v}\n" for k, v in p.params)
        self.write(f"{p.name}.txt", f"# after pass {p.name}\n{params}{self.text(module)}")


@dataclass
class PassTiming:
    """Seconds per pass, in the order they ran."""

    seconds: list[tuple[str, float]] = field(default_factory=list)

    def after_pass(self, index: int, p: Pass, module: Module, seconds: float) -> None:
        self.seconds.append((p.name, seconds))

    def table(self) -> str:
        width = max((len(n) for n, _ in self.seconds), default=4)
        return "\n".join(f"{n:<{width}}  {s * 1e3:8.2f} ms" for n, s in self.seconds)


class VerifyIR:
    """Runs the verifier after each pass and names the pass that broke an invariant."""

    def after_pass(self, index: int, p: Pass, module: Module, seconds: float) -> None:
        from .verify import verify_module

        try:
            verify_module(module)
        except TeccError as exc:
            raise type(exc)(f"after pass {p.name}: {exc}") from exc


class PassManager:
    """Runs `passes` in order; each instrument sees the module after each pass."""

    def __init__(self, passes: Sequence[Pass], instruments: Sequence[Instrument] = ()) -> None:
        self.passes = list(passes)
        self.instruments = list(instruments)

    def run(self, module: Module) -> Module:
        for i, p in enumerate(self.passes):
            start = time.perf_counter()
            module = p(module)
            elapsed = time.perf_counter() - start
            for inst in self.instruments:
                inst.after_pass(i, p, module, elapsed)
        return module
