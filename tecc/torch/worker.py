"""The worker process of option `parallel_compile` (background.py): `python -m tecc.torch.worker
REQUEST` compiles the request's ATen graph as the caller would and stores it in tecc's disk cache
under the caller's key (`backend.compile_stored`); exit status 0 when it stored it."""

from __future__ import annotations

import pickle
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    """The worker: compile the request's graph into the disk cache (`backend.compile_stored`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from . import backend

    request = pickle.loads(Path(argv[0]).read_bytes())
    Path(argv[0]).unlink(missing_ok=True)
    gm = GraphPickler.loads(request["graph"], FakeTensorMode(shape_env=ShapeEnv()))
    start = time.perf_counter()
    _, stored = backend.compile_stored(gm, request["options"], request["name"], request["key"],
                                       request["deterministic"], [], start, request["target"])
    print(f"tecc worker: graph {request['name']} compiled in {time.perf_counter() - start:.1f} s"
          + ("" if stored else ", not stored"), flush=True)
    return 0 if stored else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
