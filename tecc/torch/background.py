"""A graph compiled in a process of its own while this one compiles the next (option
`parallel_compile`).

With the option `aot_cache` AOTAutograd compiles the backward graph right after the forward,
before either runs; tecc's planner is Python, one graph at a time per process. So the forward
graph goes to a worker process (`python -m tecc.torch.worker REQUEST`: torch's GraphPickler
bytes of the ATen graph, the options, the name and the graph's key in tecc's disk cache), which
compiles it as this process would and stores it in the disk cache under that key, while this
process compiles the backward. The forward's callable (`Pending`) waits for the worker at its
first call and loads the graph from the disk cache; where the worker failed (its log's tail is
logged) it compiles the graph in this process then, as without the option (a TeccError of
`fallback="error"` is raised there).

`wanted` says when: for a graph built for CUDA (the emulator's are not kept in the disk cache),
the option True, or left None (auto) for one of at least MIN_NODES ops on a machine of at least
MIN_CPUS CPUs (the worker's start, ~2-3 s of importing torch, is hidden behind the backward's
compile only when that takes longer). The worker plans for the live GPU's properties, as this
process does (the options go as they are: an `arch` left None stays None). The graph must
have no tensor constants (lifted into inputs by the compile, which the key does not see) and
its key must be known (the disk cache on, no dumps asked).
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from torch.fx import GraphModule

log = logging.getLogger("tecc.torch")

MIN_NODES = 150   # ATen ops of a graph worth a worker of its own (auto)
MIN_CPUS = 4      # a worker beside this process's compile needs cores of its own (auto)

_RUNNING: list[subprocess.Popen[bytes]] = []
# this process's workers: started; graphs loaded from a worker's entry; graphs compiled here
# after their worker failed; seconds the graphs' first calls waited for their workers
STATS: dict[str, float] = {"started": 0, "loaded": 0, "compiled_here": 0, "waited_s": 0.0}


def wanted(gm: GraphModule, option: bool | None, target: str) -> bool:
    """Whether the graph compiles in a worker (module docstring): the option, else auto; never
    a graph built for the emulator (target "sim", which the disk cache does not hold)."""
    if target == "sim" or option is False:
        return False
    if option:
        return True
    ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    return ops >= MIN_NODES and (os.cpu_count() or 1) >= MIN_CPUS


class Pending:
    """A graph's callable while a worker compiles it: the first call waits for the worker and
    loads the graph from tecc's disk cache (`load(key)`), else compiles it here (`fallback()`)."""

    _boxed_call = True

    def __init__(self, name: str, key: str, process: subprocess.Popen[bytes], log_path: Path,
                 load: Callable[[str], Any], fallback: Callable[[], Any]) -> None:
        self.name, self.key, self.process, self.log_path = name, key, process, log_path
        self._load, self._fallback = load, fallback
        self.fn: Any = None
        self.waited = 0.0   # seconds the first call waited for the worker

    def __call__(self, inputs: Any) -> Any:
        return self.resolve()(inputs)

    def resolve(self) -> Any:
        """The compiled graph's callable (waits for the worker once)."""
        if self.fn is None:
            start = time.perf_counter()
            code = self.process.wait()
            self.waited = time.perf_counter() - start
            STATS["waited_s"] = round(STATS["waited_s"] + self.waited, 2)
            _forget(self.process)
            fn = self._load(self.key) if code == 0 else None
            if fn is None:
                log.warning("tecc: the worker compiling graph %s %s; compiling it in this process (worker's log: %s)",
                            self.name, f"exited with {code}" if code else "stored nothing", _tail(self.log_path))
                fn = self._fallback()
                STATS["compiled_here"] += 1
            else:
                STATS["loaded"] += 1
                log.info("tecc: graph %s compiled by a worker (waited %.1f s at its first call)", self.name, self.waited)
            self.fn = fn
            shutil.rmtree(self.log_path.parent, ignore_errors=True)
        return self.fn


def start(graph: bytes, options: Any, name: str, key: str, deterministic: bool, target: str,
          load: Callable[[str], Any], fallback: Callable[[], Any]) -> Pending | None:
    """Start a worker compiling the ATen graph `graph` (GraphPickler bytes) for `target` into the
    disk cache under `key`; its Pending callable, or None where no worker could be started (the
    reason logged: the caller compiles the graph itself)."""
    folder = Path(tempfile.mkdtemp(prefix="tecc-worker-"))
    request = folder / "request.pickle"
    request.write_bytes(pickle.dumps({"graph": graph, "options": options, "name": name, "key": key,
                                      "deterministic": deterministic, "target": target}))
    log_path = folder / "worker.log"
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])   # the folder holding the tecc package
    env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    try:
        with open(log_path, "wb") as out:
            process = subprocess.Popen([sys.executable, "-m", "tecc.torch.worker", str(request)],
                                       stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    except OSError as exc:
        log.warning("tecc: no worker for graph %s (%s); compiling it in this process", name, exc)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    _RUNNING.append(process)
    STATS["started"] += 1
    log.info("tecc: graph %s compiling in a worker (pid %d)", name, process.pid)
    return Pending(name, key, process, log_path, load, fallback)


def _forget(process: subprocess.Popen[bytes]) -> None:
    if process in _RUNNING:
        _RUNNING.remove(process)


def _tail(path: Path, lines: int = 6) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:]) or "(empty)"
    except OSError:
        return "(none)"


@atexit.register
def _stop_workers() -> None:
    """A process ending before its graphs ran stops their workers (nothing waits for them)."""
    for process in list(_RUNNING):
        if process.poll() is None:
            process.terminate()
